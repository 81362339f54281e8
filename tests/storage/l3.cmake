# The L3 suite runs once per I/O path: storage_test_l3 (pread/pwrite, registered by the glob)
# and this second run through io_uring, which exits 77 only where the kernel refuses io_uring.
add_test(NAME storage_test_l3_uring COMMAND storage_test_l3 --io=uring)
set_tests_properties(storage_test_l3_uring PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300
                     ENVIRONMENT "CK_DEFAULT_TIMEOUT=120")
