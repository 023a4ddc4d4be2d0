// See home_faults.h. Everything the handler touches is async-signal-safe:
// fixed tables of atomics, write(2), mprotect(2) and sigaction(2).
#include "home_faults.h"

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
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
// Set once a real fault was handed on. A handler installed over ours and then under it
// again (faulthandler.enable(), then install_on_top) restores ours when it is done and
// lets the read fault again: handing on a second time would ping-pong between the two
// forever, so the second time the default action ends the process.
std::atomic<bool> g_handed_on{false};
std::once_flag g_installed;
std::mutex g_install_mu;

// One per attached Home (homes resident at once): a device budget of 64 GiB in
// 1 MiB tensors. Past that, homes go unwatched and the daemon counts them written.
constexpr int kWatchSlots = 1 << 16;

struct Watch {
    std::atomic<int> used{0};
    std::atomic<int> busy{0};            // handlers inside this slot right now
    std::atomic<uintptr_t> start{0};     // 0: not watched (set last, cleared first)
    std::atomic<uintptr_t> end{0};
    std::atomic<uint64_t> writes{0};     // +2 per write fault taken (odd: one in progress)
};

Watch g_watch[kWatchSlots];
std::atomic<int> g_watch_top{0};         // slots at or above it were never used

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
        static const char kAdvice[] =
            "). Outside an offloaded model's forward, read managed tensors within daemon.use(...). "
            "Inside one, prefetchd did not pin this weight: it was read outside every call of its "
            "unit's cells, either through a view of it that a cell returned on a pass after the first "
            "(docs/offload.md: return a copy) or by a prefetchd bug to report (offload(units=..., "
            "no_split=...) can work around it). The read was in native code, so the process cannot "
            "continue (python -X "
            "faulthandler shows the Python line that made it; docs/stable-addresses.md).\n";
        char line[192 + sizeof kAdvice];     // the fixed text above kAdvice is 134 bytes with both addresses
        size_t n = put(line, "prefetchd: a managed tensor was read while it was not resident (address ");
        n += put_hex(line + n, a);
        n += put(line + n, " is in a home reserved at ");
        n += put_hex(line + n, start);
        n += put(line + n, kAdvice);
        ssize_t ignored = write(STDERR_FILENO, line, n);
        (void)ignored;
        return;
    }
}

enum class Write { NotWatched, Allowed, Failed };

// Whether `a` lies in a watched home. If so it is made writable and the write
// counted (Allowed), so returning from the handler re-runs the write, which
// now succeeds. A watched home is mapped (read-only), so a fault in it is a write.
Write allow_write(uintptr_t a) {
    const int top = g_watch_top.load();
    for (int i = 0; i < top; ++i) {
        Watch &w = g_watch[i];
        uintptr_t start = w.start.load();
        if (start == 0 || a < start || a >= w.end.load()) continue;
        w.busy.fetch_add(1);
        Write result = Write::NotWatched;
        if (w.start.load() == start) {   // unwatch_writes did not start meanwhile
            // Odd while the home is being made writable: a reader of the count
            // (Home::take_written) sees the write before any write can land.
            w.writes.fetch_add(1);
            const bool ok =
                mprotect(reinterpret_cast<void *>(start), w.end.load() - start, PROT_READ | PROT_WRITE) == 0;
            w.writes.fetch_add(1);
            result = ok ? Write::Allowed : Write::Failed;
        }
        w.busy.fetch_sub(1);
        if (result == Write::Failed) {
            static const char line[] =
                "prefetchd: a write to a resident managed tensor could not be let through "
                "(mprotect failed: too many mappings? see vm.max_map_count); the process cannot continue.\n";
            ssize_t ignored = write(STDERR_FILENO, line, sizeof line - 1);
            (void)ignored;
        }
        return result;
    }
    return Write::NotWatched;
}

void on_fault(int sig, siginfo_t *info, void *context) {
    (void)context;
    const bool sent = info->si_code <= 0;   // by kill(): no faulting read, si_addr holds no address
    if (!sent) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
        const Write w = allow_write(a);
        if (w == Write::Allowed) return;
        if (w == Write::NotWatched) say_if_home(a);
    }
    // Hand the fault on: returning re-runs the faulting read, which now goes to
    // the handler installed before ours (or the default action, which ends the process).
    if (g_handed_on.exchange(true)) {
        struct sigaction fallback;
        memset(&fallback, 0, sizeof fallback);
        fallback.sa_handler = SIG_DFL;
        sigemptyset(&fallback.sa_mask);
        sigaction(SIGSEGV, &fallback, nullptr);
    } else {
        sigaction(SIGSEGV, &g_previous, nullptr);
    }
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

// A handler installed over ours (e.g. faulthandler.enable() after the first
// home) would take a watched write for a crash: put ours back on top, handing
// real faults on to that one.
void install_on_top() {
    std::lock_guard<std::mutex> g(g_install_mu);
    struct sigaction current;
    if (sigaction(SIGSEGV, nullptr, &current) == 0 && (current.sa_flags & SA_SIGINFO) &&
        current.sa_sigaction == on_fault)
        return;
    install();
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

int watch_writes(uintptr_t start, size_t len) {
    install_on_top();
    // First fit, so the slots in use stay low and the handler's scan (up to the top) short.
    for (int i = 0; i < kWatchSlots; ++i) {
        int expected = 0;
        if (g_watch[i].used.load(std::memory_order_relaxed) ||
            !g_watch[i].used.compare_exchange_strong(expected, 1))
            continue;
        g_watch[i].end.store(start + len);
        g_watch[i].start.store(start);
        int top = g_watch_top.load();
        while (top <= i && !g_watch_top.compare_exchange_weak(top, i + 1)) {
        }
        return i;
    }
    return -1;
}

uint64_t watched_writes(int slot) {
    if (slot < 0 || slot >= kWatchSlots) return 0;
    return g_watch[slot].writes.load();
}

void unwatch_writes(int slot) {
    if (slot < 0 || slot >= kWatchSlots) return;
    Watch &w = g_watch[slot];
    w.start.store(0);
    while (w.busy.load()) sched_yield();   // a handler that saw the old start finishes first
    w.end.store(0);
    w.used.store(0);
}

}  // namespace pfd
