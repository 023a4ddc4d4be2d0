// The compute-fence kernel: a MindSpore AOT custom op (ops.Custom(func_type="aot")).
//
// MindSpore runs ops asynchronously even on CPU and offers only whole-queue
// fences (hal.synchronize). The layer hooks enqueue this op after each unit's
// forward: it depends on the unit's output, so MindSpore executes it after
// every kernel of that unit; it then counts itself in a word that prefetchd
// owns (the second input views prefetchd memory without a copy) and wakes any
// waiter. prefetchd queues a marker's fences under one lock and numbers them
// 1, 2, ...; PyNative launches ops from one queue, so fences run in that order
// (each unit's input is the one before's output) and the word is the epoch of
// the last one run. A device block last read at epoch e is free to reuse once
// the word reaches e, without draining the rest of the queue. A waiter that
// asked for an epoch (wake_at, native/include/fence_block.h) is woken through
// the completion queue's doorbell, so the scheduler thread sleeps on one futex
// for both its completions and the fence it needs. Were fences ever
// run out of order, the count would still never exceed the highest epoch run.
//
// The epoch is counted here rather than passed in: a fresh epoch tensor per
// fence cost MindSpore ~75 us of a ~120 us dispatch (a new input to place);
// the two inputs this kernel takes are the same tensors every time. A fence
// that never runs leaves the word behind (waits end late or time out), never
// ahead.
//
// Built by `pip install .` as prefetchd/_compute_fence*.so (plain C ABI; the
// PyInit symbol below only keeps Python's importer quiet if someone imports it).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdint>

#include "../include/fence_block.h"

extern "C" {

namespace fb = pfd::fence_block;

// params: [dependency (any dtype), block (int64[8], the fence block), output (int64[1])]
__attribute__((visibility("default"))) int ComputeFence(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                 void *stream, void *extra) {
    (void)ndims; (void)shapes; (void)dtypes; (void)stream; (void)extra;
    if (nparam != 3) return 1;
    int64_t *words = fb::words(params[1]);
    // Sequentially consistent: the waiter stores wake_at, then loads the count; this
    // adds to the count, then loads wake_at. One of the two sees the other's write,
    // so a waiter never sleeps past the fence it asked for.
    const int64_t epoch = __atomic_add_fetch(&words[fb::kCount], 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, reinterpret_cast<int *>(&words[fb::kCount]), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    const int64_t wake_at = __atomic_load_n(&words[fb::kWakeAt], __ATOMIC_SEQ_CST);
    if (wake_at > 0 && epoch >= wake_at) {
        uint32_t *bell = fb::doorbell(params[1]);
        __atomic_add_fetch(bell, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, reinterpret_cast<int *>(bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
    *static_cast<int64_t *>(params[2]) = epoch;
    return 0;
}

// Not a Python module; defined so an accidental `import` fails cleanly instead of crashing.
__attribute__((visibility("default"))) void *PyInit__compute_fence(void) { return nullptr; }
}
