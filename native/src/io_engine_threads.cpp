// pread/pwrite thread pool: `threads` workers pull chunk indices from the
// oldest pending transfer, so one large read keeps every worker busy and the
// CRC of each landed chunk runs in parallel on the worker that read it.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"
#include "io_engine.h"
#include "memory.h"

namespace pfd {
namespace {

struct Job {
    Transfer *t;
    size_t n;
    size_t next = 0;  // next chunk to hand out (under pool mutex)
    size_t finished = 0;
    bool failed = false;
    TransferResult result;
    std::condition_variable cv;
};

class ThreadEngine : public Engine {
  public:
    ThreadEngine(int threads, size_t chunk, const char *name) : chunk_(chunk), name_(name) {
        for (int i = 0; i < std::max(1, threads); i++) workers_.emplace_back([this] { loop(); });
    }
    ~ThreadEngine() override {
        {
            std::lock_guard<std::mutex> g(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto &w : workers_) w.join();
    }
    const char *name() const override { return name_; }

    TransferResult run(Transfer &t) override {
        Job job;
        job.t = &t;
        job.n = t.n_chunks();
        if (job.n == 0) return job.result;
        std::unique_lock<std::mutex> g(mu_);
        queue_.push_back(&job);
        cv_.notify_all();
        job.cv.wait(g, [&] { return job.finished == job.n; });
        return job.result;
    }

  private:
    void loop() {
        std::unique_ptr<Mapping> bounce;  // lazily, only if some chunk needs it
        std::unique_lock<std::mutex> g(mu_);
        for (;;) {
            cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stop_ and nothing left
            Job *job = queue_.front();
            size_t i = job->next++;
            if (job->next >= job->n) queue_.pop_front();  // all handed out
            bool skip = job->failed;
            g.unlock();

            TransferResult r;
            if (!skip) r = do_chunk(*job->t, i, bounce);

            g.lock();
            if (r.status != 0 && !job->failed) {
                job->failed = true;
                job->result = r;
            }
            if (++job->finished == job->n) job->cv.notify_all();
        }
    }

    TransferResult do_chunk(Transfer &t, size_t i, std::unique_ptr<Mapping> &bounce) {
        TransferResult r;
        size_t off = i * t.chunk, len = std::min(t.chunk, t.total - off);
        if (!bounce) bounce.reset(new Mapping(chunk_, kDirectAlign));
        char *buf = t.prepare(i, off, len, bounce->base);
        r.offset = t.file_base + off;
        ssize_t res = full_io(t.write, t.fd, buf, len, t.file_base + off);
        apply_fault(t, i, res, len);
        if (res < 0) {
            r.status = int(-res);
        } else if (size_t(res) < len) {
            r.status = STATUS_SHORT_READ;
            r.detail = std::string(t.write ? "short write" : "short read") + ": " + std::to_string(res) + " of " +
                       std::to_string(len) + " bytes";
        } else {
            r.status = t.complete(i, off, len, buf, r.detail);
        }
        return r;
    }

    size_t chunk_;
    const char *name_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job *> queue_;
    bool stop_ = false;
    std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Engine> make_thread_engine(int threads, size_t chunk, const char *name) {
    return std::unique_ptr<Engine>(new ThreadEngine(threads, chunk, name));
}

}  // namespace pfd
