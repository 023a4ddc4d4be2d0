// Waiting on the compute-fence word. The kernel that raises it runs inside
// MindSpore's executor; it stores the epoch (release) and FUTEX_WAKEs the low
// 32 bits' address, so a waiter sleeps on the futex instead of polling.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <ctime>

namespace pfd {

int64_t wait_word(int64_t *word, int64_t at_least, double timeout) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout < 0 ? 1e9 : timeout);
    for (;;) {
        int64_t now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (now >= at_least) return now;
        auto left = deadline - clock::now();
        if (left <= clock::duration::zero()) return now;
        // Sleep while the low half is unchanged; wake-ups and the value check above
        // make a spurious wake or a change in the high half harmless. Cap each
        // sleep so a wake lost to the 32-bit compare cannot stall us for long.
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        if (ns > 50'000'000) ns = 50'000'000;
        struct timespec ts = {static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
        syscall(SYS_futex, reinterpret_cast<int *>(word), FUTEX_WAIT, static_cast<int>(now), &ts, nullptr, 0);
    }
}

}  // namespace pfd
