// See home_faults.h. Everything the handler touches is async-signal-safe:
// a fixed table of atomics, write(2) and sigaction(2).
#include "home_faults.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace pfd {

namespace {

constexpr int kSlots = 8192;  // ranges: one per offloaded unit (and per loose tensor)

struct Slot {
    std::atomic<int> used{0};
    std::atomic<uintptr_t> start{0};  // 0: empty (set last, cleared first)
    std::atomic<uintptr_t> end{0};
};

Slot g_slots[kSlots];
struct sigaction g_previous;
std::once_flag g_installed;

size_t put(char *out, const char *s) {
    size_t n = strlen(s);
    memcpy(out, s, n);
    return n;
}

size_t put_hex(char *out, uintptr_t v) {
    char digits[2 + 2 * sizeof v];
    size_t n = 0;
    do {
        digits[n++] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v);
    out[0] = '0';
    out[1] = 'x';
    for (size_t i = 0; i < n; ++i) out[2 + i] = digits[n - 1 - i];
    return n + 2;
}

// One line to stderr if `a` lies in a registered range.
void say_if_home(uintptr_t a) {
    for (const Slot &s : g_slots) {
        uintptr_t start = s.start.load(std::memory_order_acquire);
        if (start == 0 || a < start || a >= s.end.load(std::memory_order_relaxed)) continue;
        char line[512];
        size_t n = put(line, "prefetchd: a managed tensor was read while it was not resident (address ");
        n += put_hex(line + n, a);
        n += put(line + n, " is in a home reserved at ");
        n += put_hex(line + n, start);
        n += put(line + n,
                 "). Read managed tensors only inside an offloaded model's forward or within daemon.use(...); "
                 "the read was in native code, so the process cannot continue (python -X faulthandler shows "
                 "the Python line that made it; docs/stable-addresses.md).\n");
        ssize_t ignored = write(STDERR_FILENO, line, n);
        (void)ignored;
        return;
    }
}

void on_fault(int sig, siginfo_t *info, void *context) {
    (void)context;
    const bool sent = info->si_code <= 0;   // by kill(): no faulting read, si_addr holds no address
    if (!sent) say_if_home(reinterpret_cast<uintptr_t>(info->si_addr));
    // Hand the fault on: returning re-runs the faulting read, which now goes to
    // the handler installed before ours (or the default action, which ends the process).
    sigaction(SIGSEGV, &g_previous, nullptr);
    // A signal sent by kill() has no read to re-run: send it again, to be
    // delivered to that handler once ours returns.
    if (sent) raise(sig);
}

void install() {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous);
}

}  // namespace

int register_home_range(uintptr_t start, size_t len) {
    std::call_once(g_installed, install);
    for (int i = 0; i < kSlots; ++i) {
        int expected = 0;
        if (!g_slots[i].used.compare_exchange_strong(expected, 1)) continue;
        g_slots[i].end.store(start + len, std::memory_order_relaxed);
        g_slots[i].start.store(start, std::memory_order_release);
        return i;
    }
    return -1;
}

void unregister_home_range(int slot) {
    if (slot < 0 || slot >= kSlots) return;
    g_slots[slot].start.store(0, std::memory_order_release);
    g_slots[slot].end.store(0, std::memory_order_relaxed);
    g_slots[slot].used.store(0, std::memory_order_release);
}

}  // namespace pfd
