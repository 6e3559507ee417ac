/* An LD_PRELOAD layer for scripts/fault_campaign.py: in each process, the first
 * TG_EIO_MANIFEST_OPENS opens of a file named manifest.json fail with EIO (a flaky shared file
 * system), then they go through. Build: cc -shared -fPIC -o eio_preload.so eio_preload.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static int left = -1; /* opens still to fail in this process; -1: not read from the environment yet */

static int fails(const char *path) {
    if (left < 0) {
        const char *n = getenv("TG_EIO_MANIFEST_OPENS");
        left = n ? atoi(n) : 0;
    }
    size_t len = path ? strlen(path) : 0;
    if (left > 0 && len >= 13 && strcmp(path + len - 13, "manifest.json") == 0) {
        left--;
        errno = EIO;
        return 1;
    }
    return 0;
}

#define WRAP(name, ...)                                                          \
    int name(__VA_ARGS__, int flags, ...) {                                      \
        mode_t mode = 0;                                                         \
        if (flags & (O_CREAT | O_TMPFILE)) {                                     \
            va_list ap;                                                          \
            va_start(ap, flags);                                                 \
            mode = va_arg(ap, mode_t);                                           \
            va_end(ap);                                                          \
        }

WRAP(open, const char *path)
    static int (*real)(const char *, int, ...);
    if (!real) real = dlsym(RTLD_NEXT, "open");
    return fails(path) ? -1 : real(path, flags, mode);
}
WRAP(open64, const char *path)
    static int (*real)(const char *, int, ...);
    if (!real) real = dlsym(RTLD_NEXT, "open64");
    return fails(path) ? -1 : real(path, flags, mode);
}
WRAP(openat, int dirfd, const char *path)
    static int (*real)(int, const char *, int, ...);
    if (!real) real = dlsym(RTLD_NEXT, "openat");
    return fails(path) ? -1 : real(dirfd, path, flags, mode);
}
WRAP(openat64, int dirfd, const char *path)
    static int (*real)(int, const char *, int, ...);
    if (!real) real = dlsym(RTLD_NEXT, "openat64");
    return fails(path) ? -1 : real(dirfd, path, flags, mode);
}
