// The compute-fence kernel: a MindSpore AOT custom op (ops.Custom(func_type="aot")).
//
// MindSpore runs ops asynchronously even on CPU and offers only whole-queue
// fences (hal.synchronize). The layer hooks enqueue this op after each unit's
// forward: it depends on the unit's output, so MindSpore executes it after
// every kernel of that unit; it then stores the unit's epoch into a word that
// prefetchd owns (the third input views prefetchd memory without a copy) and
// wakes any waiter. A device block last read at epoch e is free to reuse once
// the word reaches e, without draining the rest of the queue.
//
// Built by `pip install .` as prefetchd/_compute_fence*.so (plain C ABI; the
// PyInit symbol below only keeps Python's importer quiet if someone imports it).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdint>

extern "C" {

// params: [dependency (any dtype), epoch (int64[1]), word (int64[1]), output (int64[1])]
__attribute__((visibility("default"))) int ComputeFence(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                 void *stream, void *extra) {
    (void)ndims; (void)shapes; (void)dtypes; (void)stream; (void)extra;
    if (nparam != 4) return 1;
    const int64_t epoch = *static_cast<const int64_t *>(params[1]);
    auto *word = static_cast<int64_t *>(params[2]);
    int64_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
    while (seen < epoch && !__atomic_compare_exchange_n(word, &seen, epoch, true, __ATOMIC_RELEASE,
                                                        __ATOMIC_RELAXED)) {
    }
    syscall(SYS_futex, reinterpret_cast<int *>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    *static_cast<int64_t *>(params[3]) = epoch;
    return 0;
}

// Not a Python module; defined so an accidental `import` fails cleanly instead of crashing.
__attribute__((visibility("default"))) void *PyInit__compute_fence(void) { return nullptr; }
}
