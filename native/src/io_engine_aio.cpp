// Kernel AIO through raw syscalls (no libaio needed). A transfer keeps up to
// `queue_depth` chunk requests in flight and submits them in batches: on a
// virtio disk batched large requests reach the device merged, which matters
// more than depth. Checksums run on the submitting thread while the kernel
// works on the remaining requests.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "common.h"
#include "io_engine.h"
#include "memory.h"

namespace pfd {
namespace {

long sys_io_setup(unsigned nr, aio_context_t *ctx) { return syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb **cbs) { return syscall(SYS_io_submit, ctx, n, cbs); }
long sys_io_getevents(aio_context_t ctx, long min, long max, io_event *ev, timespec *ts) {
    return syscall(SYS_io_getevents, ctx, min, max, ev, ts);
}

struct Slot {
    iocb cb;
    size_t chunk = 0;
    char *bounce = nullptr;
    char *buf = nullptr;
    bool busy = false;
};

// One io context plus its slots and bounce memory; reused across transfers.
struct Context {
    aio_context_t ctx = 0;
    std::vector<Slot> slots;
    std::unique_ptr<Mapping> bounce;
    Context(int qd, size_t chunk) : slots(size_t(qd)) {
        if (sys_io_setup(unsigned(qd), &ctx) != 0) {
            int e = errno;
            throw Error(ErrKind::IOFailure, "io_setup failed: " + errno_name(e), e);
        }
        bounce.reset(new Mapping(size_t(qd) * chunk, kDirectAlign));  // virtual until touched
        for (size_t i = 0; i < slots.size(); i++) slots[i].bounce = bounce->base + i * chunk;
    }
    ~Context() { sys_io_destroy(ctx); }
};

class AioEngine : public Engine {
  public:
    AioEngine(int qd, size_t chunk) : qd_(std::max(1, qd)), chunk_(chunk) {}
    ~AioEngine() override = default;  // contexts die with the pool; no I/O is in flight then
    const char *name() const override { return "aio"; }

    TransferResult run(Transfer &t) override {
        std::unique_ptr<Context> c = acquire();
        TransferResult r = drive(*c, t);
        release(std::move(c));
        return r;
    }

  private:
    std::unique_ptr<Context> acquire() {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (!idle_.empty()) {
                auto c = std::move(idle_.back());
                idle_.pop_back();
                return c;
            }
        }
        return std::unique_ptr<Context>(new Context(qd_, chunk_));
    }
    void release(std::unique_ptr<Context> c) {
        std::lock_guard<std::mutex> g(mu_);
        idle_.push_back(std::move(c));
    }

    static void fail(TransferResult &r, int status, uint64_t off, std::string detail = "") {
        if (r.status != 0) return;  // first error wins
        r.status = status;
        r.offset = off;
        r.detail = std::move(detail);
    }

    // Fill every free slot with the next chunks and submit them in one batch.
    void submit_free_slots(Context &c, Transfer &t, size_t &next, size_t &inflight, TransferResult &r,
                           std::vector<iocb *> &batch) {
        const size_t n = t.n_chunks();
        batch.clear();
        for (auto &s : c.slots) {
            if (s.busy || next >= n || r.status != 0) continue;
            size_t off = next * t.chunk, len = std::min(t.chunk, t.total - off);
            s.chunk = next++;
            s.buf = t.prepare(s.chunk, off, len, s.bounce);
            memset(&s.cb, 0, sizeof(s.cb));
            s.cb.aio_data = reinterpret_cast<uint64_t>(&s);
            s.cb.aio_lio_opcode = t.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
            s.cb.aio_fildes = uint32_t(t.fd);
            s.cb.aio_buf = reinterpret_cast<uint64_t>(s.buf);
            s.cb.aio_nbytes = len;
            s.cb.aio_offset = int64_t(t.file_base + off);
            s.busy = true;
            batch.push_back(&s.cb);
        }
        size_t submitted = 0;
        while (submitted < batch.size()) {
            long k = sys_io_submit(c.ctx, long(batch.size() - submitted), batch.data() + submitted);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                // Not accepted: do the rest synchronously so the transfer still completes.
                for (size_t j = submitted; j < batch.size(); j++) {
                    Slot *s = reinterpret_cast<Slot *>(batch[j]->aio_data);
                    ssize_t res = full_io(t.write, t.fd, s->buf, batch[j]->aio_nbytes, batch[j]->aio_offset);
                    s->busy = false;
                    finish(t, s->chunk, s->buf, res, r);
                }
                break;
            }
            submitted += size_t(k);
            inflight += size_t(k);
        }
    }

    TransferResult drive(Context &c, Transfer &t) {
        TransferResult r;
        const size_t n = t.n_chunks();
        size_t next = 0, inflight = 0;
        std::vector<iocb *> batch;
        std::vector<io_event> events(c.slots.size());
        for (;;) {
            submit_free_slots(c, t, next, inflight, r, batch);
            if (inflight == 0) {
                if (next >= n || r.status != 0) break;
                continue;
            }
            long got = sys_io_getevents(c.ctx, 1, long(events.size()), events.data(), nullptr);
            if (got < 0) {
                if (errno == EINTR) continue;
                // Cannot reap: requests still own their buffers, so wait them out one by one.
                fail(r, errno, 0, "io_getevents");
                got = 0;
                while (inflight > 0) {
                    long g2 = sys_io_getevents(c.ctx, 1, long(events.size()), events.data(), nullptr);
                    if (g2 > 0) inflight -= size_t(g2);
                }
                break;
            }
            // Reaped requests whose data sits in user memory free their slot at
            // once, so the refill is submitted before we spend CPU on their
            // checksums; bounce-buffered ones must be consumed first.
            struct Done { size_t chunk; char *buf; ssize_t res; };
            std::vector<Done> deferred;
            for (long e = 0; e < got; e++) {
                Slot *s = reinterpret_cast<Slot *>(events[size_t(e)].data);
                inflight--;
                ssize_t res = ssize_t(events[size_t(e)].res);
                if (s->buf == s->bounce) {
                    finish(t, s->chunk, s->buf, res, r);
                } else {
                    deferred.push_back({s->chunk, s->buf, res});
                }
                s->busy = false;
            }
            if (!deferred.empty()) {
                submit_free_slots(c, t, next, inflight, r, batch);
                for (auto &d : deferred) finish(t, d.chunk, d.buf, d.res, r);
            }
        }
        return r;
    }

    // One request came back: apply faults, finish short transfers synchronously
    // (this surfaces the real errno, e.g. EFBIG), then hand the bytes over.
    void finish(Transfer &t, size_t chunk, char *buf, ssize_t res, TransferResult &r) {
        size_t off = chunk * t.chunk, len = std::min(t.chunk, t.total - off);
        apply_fault(t, chunk, res, len);
        bool injected_short = chunk == 0 && t.fault.kind == FaultKind::Short;
        if (res >= 0 && size_t(res) < len && !injected_short) {
            ssize_t more = full_io(t.write, t.fd, buf + res, len - size_t(res), t.file_base + off + size_t(res));
            res = more < 0 ? more : res + more;
        }
        if (r.status != 0) return;  // already failing: just drain
        if (res < 0) return fail(r, int(-res), t.file_base + off);
        if (size_t(res) < len)
            return fail(r, STATUS_SHORT_READ, t.file_base + off,
                        std::string(t.write ? "short write" : "short read") + ": " + std::to_string(res) + " of " +
                            std::to_string(len) + " bytes");
        std::string detail;
        int st = t.complete(chunk, off, len, buf, detail);
        if (st != 0) fail(r, st, t.file_base + off, detail);
    }

    int qd_;
    size_t chunk_;
    std::mutex mu_;
    std::vector<std::unique_ptr<Context>> idle_;
};

}  // namespace

std::unique_ptr<Engine> make_aio_engine(int queue_depth, size_t chunk) {
    return std::unique_ptr<Engine>(new AioEngine(queue_depth, chunk));
}

bool aio_available() {
    aio_context_t ctx = 0;
    if (sys_io_setup(1, &ctx) != 0) return false;
    sys_io_destroy(ctx);
    return true;
}

bool io_uring_available() {
#ifdef SYS_io_uring_setup
    unsigned char params[120] = {0};  // struct io_uring_params; kernel wants it zeroed
    long fd = syscall(SYS_io_uring_setup, 1, params);
    if (fd < 0) return false;
    close(int(fd));
    return true;
#else
    return false;
#endif
}

std::string aio_probe(int fd) {
    aio_context_t ctx = 0;
    if (sys_io_setup(1, &ctx) != 0) return "io_setup: " + errno_name(errno);
    Mapping buf(kDirectAlign, kDirectAlign);
    iocb cb;
    memset(&cb, 0, sizeof(cb));
    cb.aio_lio_opcode = IOCB_CMD_PREAD;
    cb.aio_fildes = uint32_t(fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(buf.base);
    cb.aio_nbytes = kDirectAlign;
    cb.aio_offset = 0;
    iocb *list[1] = {&cb};
    std::string why;
    if (sys_io_submit(ctx, 1, list) != 1) {
        why = "io_submit: " + errno_name(errno);
    } else {
        io_event ev;
        long got;
        do got = sys_io_getevents(ctx, 1, 1, &ev, nullptr);
        while (got < 0 && errno == EINTR);
        if (got != 1) why = "io_getevents: " + errno_name(errno);
        else if (ev.res != long(kDirectAlign)) why = "probe read returned " + std::to_string(ev.res);
    }
    sys_io_destroy(ctx);
    return why;
}

}  // namespace pfd

