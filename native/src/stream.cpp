// Streams, events and completion queues. Workers never touch Python: buffers
// are released by keep-alive deleters that hand them back to the GIL side.
#include "stream.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>

#include "common.h"

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

void CompletionQueue::push(Completion c) {
    {
        std::lock_guard<std::mutex> g(mu_);
        q_.push_back(std::move(c));
    }
    cv_.notify_one();
}

void CompletionQueue::notify() {
    {
        std::lock_guard<std::mutex> g(mu_);
        notifies_++;
    }
    cv_.notify_one();
}

std::vector<Completion> CompletionQueue::wait(double timeout_s, size_t max_items) {
    std::unique_lock<std::mutex> g(mu_);
    auto ready = [&] { return !q_.empty() || notifies_ > 0; };
    if (timeout_s < 0) cv_.wait(g, ready);
    else cv_.wait_for(g, std::chrono::duration<double>(timeout_s), ready);
    if (notifies_ > 0) notifies_--;  // one notify() wakes one wait()
    std::vector<Completion> out;
    while (!q_.empty() && out.size() < max_items) {
        out.push_back(std::move(q_.front()));
        q_.pop_front();
    }
    return out;
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
