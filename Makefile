# tierkv: the two set-up commands are `make demo` and `make test`.
BUILD      ?= build
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all deps build test demo bench serve clean fuzz

all: build

deps:
	@scripts/install-deps

$(BUILD)/CMakeCache.txt: | deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS) >/dev/null

build: deps $(BUILD)/CMakeCache.txt
	@cmake --build $(BUILD) -j $(JOBS) -- --no-print-directory

# The engines venv (scripts/python-env) is built before ctest, outside the tests' time limits
# (once per machine; later runs find it). Where it cannot be built the Python tests exit 77.
test: build
	@scripts/python-env >/dev/null || echo "make test: no engines venv; the Python tests will skip" >&2
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

demo: build
	@scripts/demo $(BUILD) $(DEMO_ARGS)

serve: build
	@scripts/serve $(BUILD)

bench: build
	@scripts/bench $(BUILD)

# libFuzzer harnesses (clang), each FUZZ_SECONDS long or FUZZ_RUNS executions, FUZZ_JOBS at a
# time; figures appended to build-fuzz/fuzz-results.txt
FUZZ_SECONDS ?= 600
FUZZ_JOBS ?= 1
fuzz: deps
	@TKV_FUZZ_RUNS=$(FUZZ_RUNS) FUZZ_JOBS=$(FUZZ_JOBS) tests/fuzz/run long $(FUZZ_SECONDS) $(FUZZ_NAMES)

clean:
	rm -rf $(BUILD) build-asan build-fuzz
