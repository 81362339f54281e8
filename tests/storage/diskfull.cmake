# The full-disk test on a real small file system (loop-mounted ext4, else tmpfs size=);
# exits 77 where this process may not mount. The injected-ENOSPC run (the glob's
# storage_test_diskfull) always runs.
add_test(NAME storage_test_diskfull_mount COMMAND storage_test_diskfull --mount)
set_tests_properties(storage_test_diskfull_mount PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300
                     ENVIRONMENT "CK_DEFAULT_TIMEOUT=120")
