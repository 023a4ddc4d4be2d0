// Copy streams (one worker thread + FIFO each), events fencing their ops, and
// completion queues that deliver results without polling. Pure C++: Python
// buffers are held by opaque keep-alive handles whose deleters module.cpp owns.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pfd {

struct Completion {
    int64_t tag = 0;
    int status = 0;
    std::string message;
    uint64_t nbytes = 0;
    uint64_t result = 0;
    int64_t start_ns = 0, end_ns = 0;
};

class EventState {
  public:
    explicit EventState(int64_t tag) { c_.tag = tag; }
    void complete(const Completion &c);
    bool done() const;
    bool wait(double timeout_s);  // < 0: forever; false on timeout
    Completion snapshot() const;  // fields as of now (final once done)
    bool is_record = false;

  private:
    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false;
    Completion c_;
};

class Block;

// Completions from the streams, notify() from other threads, and the compute fence
// its waiter asked for (watch_fence) all wake one wait(): it sleeps on the doorbell
// of its fence block (fence_block.h), which push/notify and the fence kernel ring.
class CompletionQueue {
  public:
    CompletionQueue();
    void push(Completion c);
    void notify();
    // Returns what is queued (at most max_items) once something is, a notify() came,
    // or the watched fence was reached; empty on timeout (< 0: forever).
    std::vector<Completion> wait(double timeout_s, size_t max_items);
    size_t pending() const;
    // Wake wait() once the block's fence count reaches epoch; true if that raised the
    // epoch watched (one epoch at a time, the highest asked for; it fires once).
    bool watch_fence(int64_t epoch);
    const std::shared_ptr<Block> &fence_block() const { return block_; }

  private:
    void ring();
    bool fence_reached();

    std::shared_ptr<Block> block_;
    void *words_;
    mutable std::mutex mu_;
    std::deque<Completion> q_;
    long notifies_ = 0;
};

// What an op's body reports; throwing pfd::Error marks it failed instead.
struct OpOutcome {
    uint64_t nbytes = 0;
    uint64_t result = 0;
};

struct Op {
    std::function<void(OpOutcome &)> body;        // empty for record()/wait_event()
    std::shared_ptr<EventState> wait_on;          // wait_event(): block until this completes
    std::shared_ptr<EventState> event;            // completed when the op finishes (null for waits)
    std::shared_ptr<CompletionQueue> cq;          // optional
    std::vector<std::shared_ptr<void>> keep;      // buffers/objects alive until completion
};

class Stream {
  public:
    explicit Stream(std::string name);
    ~Stream();
    void submit(Op op);  // Closed after close()
    void synchronize();
    bool query() const;
    size_t pending() const;
    void close();  // drain, join
    bool closed() const;
    const std::string &name() const { return name_; }
    // The worker's kernel thread id (gettid), so its priority can be set (setpriority).
    long native_id() const;

  private:
    void loop();
    std::string name_;
    mutable std::mutex mu_;
    std::condition_variable cv_, idle_cv_;
    std::deque<Op> q_;
    size_t pending_ = 0;
    bool closing_ = false, joined_ = false;
    long tid_ = 0;  // set by the worker before the constructor returns
    std::condition_variable started_cv_;
    std::thread worker_;
};

}  // namespace pfd
