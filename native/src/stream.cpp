// Streams, events and completion queues. Workers never touch Python: buffers
// are released by keep-alive deleters that hand them back to the GIL side.
#include "stream.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <ctime>

#include "common.h"
#include "fence_block.h"
#include "memory.h"

namespace pfd {

// ---------------------------------------------------------------- EventState

void EventState::complete(const Completion &c) {
    {
        std::lock_guard<std::mutex> g(mu_);
        int64_t tag = c_.tag;
        c_ = c;
        c_.tag = tag;
        done_ = true;
    }
    cv_.notify_all();
}

bool EventState::done() const {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
}

bool EventState::wait(double timeout_s) {
    std::unique_lock<std::mutex> g(mu_);
    if (timeout_s < 0) {
        cv_.wait(g, [&] { return done_; });
        return true;
    }
    return cv_.wait_for(g, std::chrono::duration<double>(timeout_s), [&] { return done_; });
}

Completion EventState::snapshot() const {
    std::lock_guard<std::mutex> g(mu_);
    return c_;
}

// ---------------------------------------------------------------- CompletionQueue

namespace fb = fence_block;

CompletionQueue::CompletionQueue() : block_(aligned_buffer(fb::kBytes, 4096)), words_(block_->data()) {
    std::memset(words_, 0, fb::kBytes);
}

void CompletionQueue::ring() {
    uint32_t *bell = fb::doorbell(words_);
    __atomic_add_fetch(bell, 1, __ATOMIC_SEQ_CST);
    // Not FUTEX_*_PRIVATE, here or in wait(): the fence kernel wakes without it, and a
    // private and a shared futex on the same anonymous page are different keys.
    syscall(SYS_futex, reinterpret_cast<int *>(bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void CompletionQueue::push(Completion c) {
    {
        std::lock_guard<std::mutex> g(mu_);
        q_.push_back(std::move(c));
    }
    ring();
}

void CompletionQueue::notify() {
    {
        std::lock_guard<std::mutex> g(mu_);
        notifies_++;
    }
    ring();
}

bool CompletionQueue::watch_fence(int64_t epoch) {
    int64_t *wake_at = &fb::words(words_)[fb::kWakeAt];
    int64_t now = __atomic_load_n(wake_at, __ATOMIC_SEQ_CST);
    while (epoch > now)   // sequentially consistent: ordered before wait()'s load of the count
        if (__atomic_compare_exchange_n(wake_at, &now, epoch, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return true;
    return false;
}

bool CompletionQueue::fence_reached() {
    int64_t *words = fb::words(words_);
    int64_t wake_at = __atomic_load_n(&words[fb::kWakeAt], __ATOMIC_SEQ_CST);
    if (wake_at <= 0 || __atomic_load_n(&words[fb::kCount], __ATOMIC_SEQ_CST) < wake_at) return false;
    // Fires once: a later watch_fence() asks again (a raise meanwhile keeps watching).
    __atomic_compare_exchange_n(&words[fb::kWakeAt], &wake_at, 0, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return true;
}

std::vector<Completion> CompletionQueue::wait(double timeout_s, size_t max_items) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s < 0 ? 1e9 : timeout_s);
    uint32_t *bell = fb::doorbell(words_);
    std::vector<Completion> out;
    for (;;) {
        // Read the doorbell before looking: a ring after this changes it, and the
        // futex wait below then returns at once instead of sleeping through it.
        const uint32_t seen = __atomic_load_n(bell, __ATOMIC_SEQ_CST);
        {
            std::lock_guard<std::mutex> g(mu_);
            if (!q_.empty() || notifies_ > 0) {
                if (notifies_ > 0) notifies_--;  // one notify() wakes one wait()
                while (!q_.empty() && out.size() < max_items) {
                    out.push_back(std::move(q_.front()));
                    q_.pop_front();
                }
                return out;
            }
        }
        if (fence_reached()) return out;
        auto left = deadline - clock::now();
        if (left <= clock::duration::zero()) return out;
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        if (ns > 1'000'000'000) ns = 1'000'000'000;
        struct timespec ts = {static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
        syscall(SYS_futex, reinterpret_cast<int *>(bell), FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
}

size_t CompletionQueue::pending() const {
    std::lock_guard<std::mutex> g(mu_);
    return q_.size();
}

// ---------------------------------------------------------------- Stream

Stream::Stream(std::string name) : name_(std::move(name)) {
    worker_ = std::thread([this] {
        {
            std::lock_guard<std::mutex> g(mu_);
            tid_ = long(syscall(SYS_gettid));
        }
        started_cv_.notify_all();
        loop();
    });
    std::unique_lock<std::mutex> g(mu_);
    started_cv_.wait(g, [&] { return tid_ != 0; });
}

long Stream::native_id() const {
    std::lock_guard<std::mutex> g(mu_);
    return tid_;
}

Stream::~Stream() { close(); }

void Stream::submit(Op op) {
    {
        std::lock_guard<std::mutex> g(mu_);
        if (closing_) throw Error(ErrKind::Closed, "stream '" + name_ + "' is closed");
        q_.push_back(std::move(op));
        pending_++;
    }
    cv_.notify_one();
}

void Stream::loop() {
    for (;;) {
        Op op;
        {
            std::unique_lock<std::mutex> g(mu_);
            cv_.wait(g, [&] { return closing_ || !q_.empty(); });
            if (q_.empty()) return;  // closing and drained
            op = std::move(q_.front());
            q_.pop_front();
        }
        if (op.wait_on) op.wait_on->wait(-1);
        Completion c;
        c.start_ns = now_ns();
        if (op.body) {
            OpOutcome out;
            try {
                op.body(out);
                c.nbytes = out.nbytes;
                c.result = out.result;
            } catch (const Error &e) {
                c.status = status_of(e);
                c.message = e.what();
            } catch (const std::exception &e) {
                c.status = EIO;
                c.message = e.what();
            }
        }
        c.end_ns = op.body ? now_ns() : c.start_ns;  // record(): zero duration
        op.keep.clear();  // buffers go back before anyone can observe completion
        if (op.event) {
            c.tag = op.event->snapshot().tag;
            op.event->complete(c);
        }
        if (op.cq) op.cq->push(c);
        op = Op();
        {
            std::lock_guard<std::mutex> g(mu_);
            pending_--;
        }
        idle_cv_.notify_all();
    }
}

void Stream::synchronize() {
    std::unique_lock<std::mutex> g(mu_);
    idle_cv_.wait(g, [&] { return pending_ == 0; });
}

bool Stream::query() const {
    std::lock_guard<std::mutex> g(mu_);
    return pending_ == 0;
}

size_t Stream::pending() const {
    std::lock_guard<std::mutex> g(mu_);
    return pending_;
}

bool Stream::closed() const {
    std::lock_guard<std::mutex> g(mu_);
    return closing_;
}

void Stream::close() {
    {
        std::lock_guard<std::mutex> g(mu_);
        closing_ = true;
        if (joined_) return;
        joined_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
}

}  // namespace pfd
