// pybind11 bindings: the Python contract of native/API.md. All GIL handling
// lives here; the engine files below are plain C++.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <csignal>
#include <cstring>
#include <unistd.h>

#include "bulk_copy.h"
#include "common.h"
#include "crc32c.h"
#include "faults.h"
#include "filestore.h"
#include "io_engine.h"
#include "memory.h"
#include "stream.h"

namespace py = pybind11;
using namespace pfd;

void bind_vmem(py::module_ &m);  // vmem.cpp: VirtualRange, Home, Arena.attach/detach
void bind_block_moves(py::module_ &m);  // block_moves.cpp: move_pages, Block.movable
void bind_home_parking(py::module_ &m);  // home_parking.cpp: Arena.park/attach_parked/unpark
void bind_segment_maps(py::module_ &m);  // segment_maps.cpp: Block.map_segment

namespace {

// ---------------------------------------------------------------- errors

PyObject *g_exc[7] = {};  // indexed by ErrKind

PyObject *exc_class(ErrKind k) {
    if (k == ErrKind::Value) return PyExc_ValueError;
    return g_exc[int(k)];
}

py::object make_exc(ErrKind k, int status, const std::string &msg) {
    py::object inst = py::reinterpret_borrow<py::object>(exc_class(k))(msg);
    if (k != ErrKind::Value) inst.attr("status") = status;
    return inst;
}

[[noreturn]] void raise_status(int status, const std::string &msg) {
    ErrKind k = kind_of_status(status);
    py::object inst = make_exc(k, status, msg);
    PyErr_SetObject(exc_class(k), inst.ptr());
    throw py::error_already_set();
}

// ---------------------------------------------------------------- buffers

// Py_buffers whose last owner died on a thread without the GIL wait here and
// are released by the next Python-side call (never by a worker thread, so
// workers never block on the GIL).
std::mutex g_grave_mu;
std::vector<Py_buffer *> g_grave;

void drain_graveyard() {
    std::vector<Py_buffer *> v;
    {
        std::lock_guard<std::mutex> g(g_grave_mu);
        v.swap(g_grave);
    }
    for (auto *b : v) {
        PyBuffer_Release(b);
        delete b;
    }
}

void drop_pybuffer(Py_buffer *b) {
    if (PyGILState_Check()) {
        PyBuffer_Release(b);
        delete b;
    } else {
        std::lock_guard<std::mutex> g(g_grave_mu);
        g_grave.push_back(b);
    }
}

struct BufRef {
    MemRef mem;
    std::shared_ptr<void> keep;
};

// Memory behind `obj` (a Block or anything with the buffer protocol), kept alive by `keep`.
BufRef get_buffer(py::handle obj, bool writable) {
    BufRef r;
    if (py::isinstance<Block>(obj)) {
        auto b = obj.cast<std::shared_ptr<Block>>();
        b->check_live();
        if (writable) b->ensure_writable();
        r.mem = MemRef{b->data(), b->nbytes(), b->capacity()};
        r.keep = b;  // the C++ Block holds the mapping; no Python needed later
        return r;
    }
    auto *v = new Py_buffer;
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), v, flags) != 0) {
        delete v;
        throw py::error_already_set();
    }
    r.mem = MemRef{static_cast<char *>(v->buf), size_t(v->len), size_t(v->len)};
    r.keep = std::shared_ptr<void>(v, [](void *p) { drop_pybuffer(static_cast<Py_buffer *>(p)); });
    return r;
}

size_t pick_len(long long nbytes, size_t have, const char *what) {
    if (nbytes < 0) return have;
    if (size_t(nbytes) > have)
        throw Error(ErrKind::Value, std::string(what) + " has " + std::to_string(have) + " bytes, nbytes=" +
                                        std::to_string(nbytes) + " requested");
    return size_t(nbytes);
}

// Blocks implement the buffer protocol by hand so a released Block raises
// Closed itself (pybind11's def_buffer would wrap it in a BufferError).
int block_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    try {
        auto &b = py::handle(self).cast<Block &>();
        if (b.released()) {
            py::object inst = make_exc(ErrKind::Closed, STATUS_CANCELLED, "block already released");
            PyErr_SetObject(exc_class(ErrKind::Closed), inst.ptr());
            view->obj = nullptr;
            return -1;
        }
        // A writer gets writable pages (memory.h, "Read-only pages"); a reader of a
        // block holding read-only pages gets a read-only view, so a write through it
        // is a TypeError, not a fault.
        if (flags & PyBUF_WRITABLE) b.ensure_writable();
        int readonly = b.readonly_bytes() ? 1 : 0;
        return PyBuffer_FillInfo(view, self, b.data(), Py_ssize_t(b.nbytes()), readonly, flags);
    } catch (const Error &e) {
        PyErr_SetString(PyExc_BufferError, e.what());
        view->obj = nullptr;
        return -1;
    } catch (...) {
        PyErr_SetString(PyExc_BufferError, "not a live Block");
        view->obj = nullptr;
        return -1;
    }
}

// ---------------------------------------------------------------- streams

std::mutex g_streams_mu;
std::vector<std::weak_ptr<Stream>> g_streams;  // closed at interpreter exit

struct Event {
    std::shared_ptr<EventState> st;
};

double opt_timeout(const py::object &t) { return t.is_none() ? -1.0 : std::max(0.0, t.cast<double>()); }

Event submit(Stream &s, Op op, int64_t tag, const py::object &cq) {
    drain_graveyard();
    op.event = std::make_shared<EventState>(tag);
    if (!cq.is_none()) op.cq = cq.cast<std::shared_ptr<CompletionQueue>>();
    Event ev{op.event};
    s.submit(std::move(op));
    return ev;
}

py::dict entry_dict(const Slot &s) {
    const Entry &e = *s.current;
    py::dict d;
    d["nbytes"] = e.nbytes;
    d["version"] = e.version;
    d["meta"] = py::bytes(e.meta);
    d["path"] = e.path;
    d["crc"] = e.data_crc;
    d["verified"] = s.verified;
    d["fallback_version"] = s.fallback ? py::cast(s.fallback->version) : py::none();
    return d;
}

py::list quarantine_list(const std::vector<Quarantined> &v) {
    py::list out;
    for (auto &q : v) {
        py::dict d;
        d["path"] = q.path;
        d["moved_to"] = q.moved_to;
        d["reason"] = q.reason;
        out.append(d);
    }
    return out;
}

py::dict report_dict(const RecoveryReport &r) {
    py::dict d;
    d["kept"] = r.kept;
    d["removed_tmp"] = r.removed_tmp;
    d["removed_old"] = r.removed_old;
    d["quarantined"] = quarantine_list(r.quarantined);
    return d;
}

// A store key from Python: a str whose UTF-8 form is 1..MAX_KEY_BYTES bytes.
// ValueError (limit named) otherwise, before anything touches the store.
std::string store_key(py::handle key) {
    if (!PyUnicode_Check(key.ptr()))
        throw py::type_error(std::string("store key must be str, got ") + Py_TYPE(key.ptr())->tp_name);
    Py_ssize_t n = 0;
    const char *utf8 = PyUnicode_AsUTF8AndSize(key.ptr(), &n);
    if (!utf8) {
        PyErr_Clear();
        std::string shown = py::repr(key).cast<std::string>().substr(0, 80);
        throw Error(ErrKind::Value, "store key " + shown + " cannot be encoded as UTF-8 (lone surrogate?)");
    }
    std::string k(utf8, size_t(n));
    check_key(k);
    return k;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "prefetchd tier engine: arena, host pool, file store, copy streams (see native/API.md)";

    // A write past RLIMIT_FSIZE must fail with EFBIG, not kill the process.
    signal(SIGXFSZ, SIG_IGN);

    // ------------------------------------------------------------ errors
    static py::exception<Error> native_error(m, "NativeError", PyExc_RuntimeError);
    g_exc[int(ErrKind::Native)] = native_error.ptr();
    auto sub = [&](ErrKind k, const char *name) {
        PyObject *cls = PyErr_NewException((std::string("prefetchd._native.") + name).c_str(), native_error.ptr(), nullptr);
        m.add_object(name, py::handle(cls));
        g_exc[int(k)] = cls;
    };
    sub(ErrKind::OutOfSpace, "OutOfSpace");
    sub(ErrKind::IOFailure, "IOFailure");
    sub(ErrKind::Checksum, "ChecksumMismatch");
    {
        // NotFound is also a KeyError (`except KeyError` works); str() is the
        // plain message, not KeyError's repr-quoted one.
        py::dict ns;
        ns["__str__"] = py::module_::import("builtins").attr("BaseException").attr("__str__");
        py::tuple bases = py::make_tuple(py::handle(native_error.ptr()), py::handle(PyExc_KeyError));
        PyObject *cls = PyErr_NewException("prefetchd._native.NotFound", bases.ptr(), ns.ptr());
        m.add_object("NotFound", py::handle(cls));
        g_exc[int(ErrKind::NotFound)] = cls;
    }
    sub(ErrKind::Closed, "Closed");
    static PyObject *store_in_use = PyErr_NewException("prefetchd._native.StoreInUse", g_exc[int(ErrKind::IOFailure)], nullptr);
    m.add_object("StoreInUse", py::handle(store_in_use));
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const Error &e) {
            py::object inst = make_exc(e.kind, status_of(e), e.what());
            PyErr_SetObject(exc_class(e.kind), inst.ptr());
        }
    });
    // Registered later, so tried first: a StoreInUse is also an Error.
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const StoreInUse &e) {
            py::object inst = py::reinterpret_borrow<py::object>(store_in_use)(e.what());
            inst.attr("status") = e.status;
            inst.attr("pid") = e.pid;
            PyErr_SetObject(store_in_use, inst.ptr());
        }
    });
    m.attr("STATUS_OK") = STATUS_OK;
    m.attr("STATUS_CHECKSUM") = STATUS_CHECKSUM;
    m.attr("STATUS_SHORT_READ") = STATUS_SHORT_READ;
    m.attr("STATUS_NOT_FOUND") = STATUS_NOT_FOUND;
    m.attr("STATUS_CANCELLED") = STATUS_CANCELLED;
    m.attr("MAX_KEY_BYTES") = kMaxKeyBytes;
    m.def("status_error", [](int status, const std::string &message) {
        return make_exc(kind_of_status(status), status, message);
    }, py::arg("status"), py::arg("message") = "");

    // ------------------------------------------------------------ memory
    auto block = py::class_<Block, std::shared_ptr<Block>>(m, "Block", py::buffer_protocol());
    block.def_property_readonly("address", &Block::address)
        .def_property_readonly("nbytes", &Block::nbytes)
        .def_property_readonly("capacity", &Block::capacity)
        .def_property_readonly("offset", &Block::offset)
        .def_property_readonly("released", &Block::released)
        .def("release", &Block::release)
        .def("__len__", &Block::nbytes)
        .def("__repr__", [](const Block &b) {
            return "<Block nbytes=" + std::to_string(b.nbytes()) + " offset=" + std::to_string(b.offset()) +
                   (b.released() ? " released>" : ">");
        });
    {
        auto *ht = reinterpret_cast<PyHeapTypeObject *>(block.ptr());
        ht->as_buffer.bf_getbuffer = block_getbuffer;
        ht->as_buffer.bf_releasebuffer = nullptr;
    }

    py::class_<ArenaImpl, std::shared_ptr<ArenaImpl>>(m, "Arena")
        .def(py::init([](size_t capacity, size_t alignment, bool huge_pages) {
                 py::gil_scoped_release nogil;  // populating pages takes a while
                 return std::make_shared<ArenaImpl>(capacity, alignment, huge_pages);
             }),
             py::arg("capacity"), py::arg("alignment") = 4096, py::arg("huge_pages") = false)
        .def_property_readonly("huge_pages", &ArenaImpl::huge_pages)
        .def_property_readonly("capacity", &ArenaImpl::capacity)
        .def_property_readonly("alignment", &ArenaImpl::alignment)
        .def_property_readonly("used", &ArenaImpl::used)
        .def_property_readonly("peak_used", &ArenaImpl::peak_used)
        .def_property_readonly("num_blocks", &ArenaImpl::num_blocks)
        .def_property_readonly("largest_free", &ArenaImpl::largest_free)
        .def_property_readonly("closed", &ArenaImpl::closed)
        .def("alloc", &ArenaImpl::alloc, py::arg("nbytes"), py::arg("prefer") = -1,
             "a block of nbytes; at offset `prefer` if that range is free, else best fit")
        .def("close", &ArenaImpl::close);

    py::class_<HostPoolImpl, std::shared_ptr<HostPoolImpl>>(m, "HostPool")
        .def(py::init([](size_t budget, size_t alignment, bool lock_memory, bool huge_pages) {
                 return std::make_shared<HostPoolImpl>(budget, alignment, lock_memory, huge_pages);
             }),
             py::arg("budget"), py::arg("alignment") = 4096, py::arg("lock_memory") = false,
             py::arg("huge_pages") = false)
        .def_property_readonly("huge_pages", &HostPoolImpl::huge_pages)
        .def_property_readonly("budget", &HostPoolImpl::budget)
        .def_property_readonly("used", &HostPoolImpl::used)
        .def_property_readonly("peak_used", &HostPoolImpl::peak_used)
        .def_property_readonly("locked", &HostPoolImpl::locked)
        .def_property_readonly("closed", &HostPoolImpl::closed)
        .def("alloc", [](HostPoolImpl &p, size_t n) {
            py::gil_scoped_release nogil;  // mmap + optional mlock
            return p.alloc(n);
        }, py::arg("nbytes"))
        .def("close", &HostPoolImpl::close);

    m.def("protection_changes", &protection_changes,
          "mprotect calls made so far by blocks and homes (each a TLB shootdown; memory.h)");
    m.def("aligned_buffer", &aligned_buffer, py::arg("nbytes"), py::arg("alignment") = 4096);
    bind_vmem(m);
    bind_block_moves(m);
    bind_home_parking(m);
    bind_segment_maps(m);

    // ------------------------------------------------------------ checksums
    m.def("crc32c", [](py::handle buf, uint32_t seed) {
        BufRef b = get_buffer(buf, false);
        if (b.mem.len < (64 << 10)) return crc32c(b.mem.ptr, b.mem.len, seed);
        py::gil_scoped_release nogil;
        return crc32c(b.mem.ptr, b.mem.len, seed);
    }, py::arg("buffer"), py::arg("seed") = 0);
    m.def("_crc32c_table", [](py::handle buf, uint32_t seed) {
        BufRef b = get_buffer(buf, false);
        py::gil_scoped_release nogil;
        return crc32c_table(b.mem.ptr, b.mem.len, seed);
    }, py::arg("buffer"), py::arg("seed") = 0, "portable table implementation (tests compare it with crc32c)");
    m.def("crc32c_impl", [] { return std::string(crc32c_impl()); });

    // ------------------------------------------------------------ bulk copies
    // What Stream.copy runs on its worker, callable in place (tests, benchmarks).
    m.def("bulk_copy", [](py::handle dst, py::handle src, long long nbytes) {
        BufRef d = get_buffer(dst, true), sr = get_buffer(src, false);
        size_t n = pick_len(nbytes, sr.mem.len, "src");
        if (n > d.mem.len)
            throw Error(ErrKind::Value, "dst has " + std::to_string(d.mem.len) + " bytes, copy needs " + std::to_string(n));
        py::gil_scoped_release nogil;
        bulk_copy(d.mem.ptr, sr.mem.ptr, n);
    }, py::arg("dst"), py::arg("src"), py::arg("nbytes") = -1);
    m.attr("BULK_COPY_MIN") = bulk_copy_min();

    // ------------------------------------------------------------ compute fence word
    // A 64-bit word that the compute-fence kernel (native/kernels/compute_fence.cc)
    // raises to each epoch as MindSpore executes it, then FUTEX_WAKEs. Waiting
    // here sleeps in the kernel: no polling, GIL released.
    m.def("wait_word", [](py::handle buf, int64_t at_least, double timeout) {
        BufRef b = get_buffer(buf, false);
        if (b.mem.len < 8 || reinterpret_cast<uintptr_t>(b.mem.ptr) % 8)
            throw py::value_error("wait_word needs an 8-byte aligned buffer of at least 8 bytes");
        auto *word = reinterpret_cast<int64_t *>(b.mem.ptr);
        py::gil_scoped_release nogil;
        return wait_word(word, at_least, timeout);
    }, py::arg("buffer"), py::arg("at_least"), py::arg("timeout") = -1.0,
       "block until the int64 at buffer[0:8] >= at_least or timeout (s, <0: forever); returns its value");

    // ------------------------------------------------------------ file store
    py::class_<FileStore, std::shared_ptr<FileStore>>(m, "FileStore")
        .def(py::init([](const std::string &dir, const std::string &engine, bool direct, size_t block_size,
                         int queue_depth, int io_threads, size_t extent_size, bool fsync, bool verify_data_on_open) {
                 StoreOptions o;
                 o.engine = engine;
                 o.direct = direct;
                 o.block_size = block_size;
                 o.queue_depth = queue_depth;
                 o.io_threads = io_threads;
                 o.extent_size = extent_size;
                 o.fsync = fsync;
                 o.verify_data_on_open = verify_data_on_open;
                 py::gil_scoped_release nogil;
                 return std::make_shared<FileStore>(dir, o);
             }),
             py::arg("directory"), py::arg("engine") = "auto", py::arg("direct") = true,
             py::arg("block_size") = 8 << 20, py::arg("queue_depth") = 8, py::arg("io_threads") = 4,
             py::arg("extent_size") = 1 << 20, py::arg("fsync") = true, py::arg("verify_data_on_open") = false)
        .def_property_readonly("engine", &FileStore::engine)
        .def_property_readonly("direct", &FileStore::direct)
        .def_property_readonly("probe_report", &FileStore::probe_report)
        .def_property_readonly("recovery_report", [](const FileStore &s) { return report_dict(s.recovery_report()); })
        .def_property_readonly("quarantined", [](const FileStore &s) {
            return quarantine_list(s.recovery_report().quarantined);
        })
        .def_property_readonly("block_size", [](const FileStore &s) { return s.options().block_size; })
        .def_property_readonly("queue_depth", [](const FileStore &s) { return s.options().queue_depth; })
        .def_property_readonly("io_threads", [](const FileStore &s) { return s.options().io_threads; })
        .def_property_readonly("extent_size", [](const FileStore &s) { return s.options().extent_size; })
        .def_property_readonly("directory", &FileStore::directory)
        .def_property_readonly("closed", &FileStore::closed)
        .def("keys", &FileStore::keys)
        .def("contains", [](const FileStore &s, py::handle k) { return s.contains(store_key(k)); }, py::arg("key"))
        .def("__contains__", [](const FileStore &s, py::handle k) { return s.contains(store_key(k)); })
        .def("info", [](const FileStore &s, py::handle k) { return entry_dict(s.slot(store_key(k))); }, py::arg("key"))
        .def("commit", [](FileStore &s, py::handle k, uint64_t version) {
            std::string key = store_key(k);
            py::gil_scoped_release nogil;
            return s.commit(key, version);
        }, py::arg("key"), py::arg("version"))
        .def("remove", [](FileStore &s, py::handle k) {
            std::string key = store_key(k);
            py::gil_scoped_release nogil;
            s.remove(key);
        }, py::arg("key"))
        .def("bytes_stored", &FileStore::bytes_stored)
        .def("recover", [](FileStore &s, bool verify_data) {
            RecoveryReport r;
            {
                py::gil_scoped_release nogil;
                r = s.recover(verify_data);
            }
            return report_dict(r);
        }, py::arg("verify_data") = false)
        .def("read_sync", [](FileStore &s, py::handle k, py::handle dst, bool verify) {
            std::string key = store_key(k);
            BufRef d = get_buffer(dst, true);
            py::gil_scoped_release nogil;
            return s.read(key, d.mem, verify);
        }, py::arg("key"), py::arg("dst"), py::arg("verify") = true)
        .def("write_sync", [](FileStore &s, py::handle k, py::handle src, long long nbytes, py::bytes meta) {
            std::string key = store_key(k);
            BufRef b = get_buffer(src, false);
            b.mem.len = pick_len(nbytes, b.mem.len, "src");
            std::string mt = meta;
            py::gil_scoped_release nogil;
            return s.write(key, b.mem, mt);
        }, py::arg("key"), py::arg("src"), py::arg("nbytes") = -1, py::arg("meta") = py::bytes(""))
        .def("close", [](FileStore &s) {
            py::gil_scoped_release nogil;
            s.close();
        });

    // ------------------------------------------------------------ completions
    py::class_<Completion>(m, "Completion")
        .def_readonly("tag", &Completion::tag)
        .def_readonly("status", &Completion::status)
        .def_readonly("message", &Completion::message)
        .def_readonly("nbytes", &Completion::nbytes)
        .def_readonly("result", &Completion::result)
        .def_readonly("start_ns", &Completion::start_ns)
        .def_readonly("end_ns", &Completion::end_ns)
        .def("__repr__", [](const Completion &c) {
            return "<Completion tag=" + std::to_string(c.tag) + " status=" + std::to_string(c.status) +
                   " nbytes=" + std::to_string(c.nbytes) + ">";
        });

    py::class_<CompletionQueue, std::shared_ptr<CompletionQueue>>(m, "CompletionQueue")
        .def(py::init<>())
        .def("wait", [](CompletionQueue &q, py::object timeout, size_t max_items) {
            double t = opt_timeout(timeout);
            std::vector<Completion> out;
            {
                py::gil_scoped_release nogil;
                out = q.wait(t, max_items);
            }
            drain_graveyard();
            return out;
        }, py::arg("timeout") = py::none(), py::arg("max_items") = 4096)
        .def("notify", &CompletionQueue::notify)
        .def("watch_fence", &CompletionQueue::watch_fence, py::arg("epoch"),
             "wake wait() once the fence block's count reaches epoch (native/include/fence_block.h); "
             "True if that raised the epoch watched")
        .def_property_readonly("fence_block", &CompletionQueue::fence_block,
                               "the 64-byte fence block: a ComputeMarker built on it wakes this queue's wait()")
        .def_property_readonly("pending", &CompletionQueue::pending);

    // ------------------------------------------------------------ events & streams
    py::class_<Stream, std::shared_ptr<Stream>> stream_cls(m, "Stream");
    py::class_<Event> event_cls(m, "Event");

    event_cls
        .def("query", [](Event &e) {
            bool d = e.st->done();
            if (d) drain_graveyard();
            return d;
        })
        .def("synchronize", [](Event &e, py::object timeout) {
            double t = opt_timeout(timeout);
            bool ok;
            {
                py::gil_scoped_release nogil;
                ok = e.st->wait(t);
            }
            drain_graveyard();
            if (!ok) return false;
            Completion c = e.st->snapshot();
            if (c.status != 0) raise_status(c.status, c.message);
            return true;
        }, py::arg("timeout") = py::none())
        .def("wait", [](Event &e, Stream &s) {
            Op op;
            op.wait_on = e.st;
            s.submit(std::move(op));
        }, py::arg("stream"))
        .def("elapsed_time", [](Event &e, Event &end) {
            if (!e.st->done() || !end.st->done()) throw Error(ErrKind::Native, "elapsed_time: event not completed");
            return double(end.st->snapshot().end_ns - e.st->snapshot().end_ns) / 1e6;
        }, py::arg("end"))
        .def_property_readonly("done", [](Event &e) { return e.st->done(); })
        .def_property_readonly("duration", [](Event &e) {
            Completion c = e.st->snapshot();
            return double(c.end_ns - c.start_ns) / 1e9;
        })
        .def_property_readonly("status", [](Event &e) { return e.st->snapshot().status; })
        .def_property_readonly("message", [](Event &e) { return e.st->snapshot().message; })
        .def_property_readonly("nbytes", [](Event &e) { return e.st->snapshot().nbytes; })
        .def_property_readonly("result", [](Event &e) { return e.st->snapshot().result; })
        .def_property_readonly("tag", [](Event &e) { return e.st->snapshot().tag; })
        .def_property_readonly("start_ns", [](Event &e) { return e.st->snapshot().start_ns; })
        .def_property_readonly("end_ns", [](Event &e) { return e.st->snapshot().end_ns; })
        .def("__repr__", [](Event &e) {
            Completion c = e.st->snapshot();
            return std::string("<Event tag=") + std::to_string(c.tag) +
                   (e.st->done() ? " done status=" + std::to_string(c.status) : std::string(" pending")) + ">";
        });

    stream_cls
        .def(py::init([](const std::string &name) {
                 auto s = std::make_shared<Stream>(name);
                 std::lock_guard<std::mutex> g(g_streams_mu);
                 g_streams.erase(std::remove_if(g_streams.begin(), g_streams.end(),
                                                [](auto &w) { return w.expired(); }),
                                 g_streams.end());
                 g_streams.push_back(s);
                 return s;
             }),
             py::arg("name") = "")
        .def("copy", [](Stream &s, py::handle dst, py::handle src, long long nbytes, int64_t tag, py::object cq) {
            BufRef d = get_buffer(dst, true), sr = get_buffer(src, false);
            size_t n = pick_len(nbytes, sr.mem.len, "src");
            if (n > d.mem.len)
                throw Error(ErrKind::Value, "dst has " + std::to_string(d.mem.len) + " bytes, copy needs " + std::to_string(n));
            Op op;
            char *dp = d.mem.ptr;
            const char *sp = sr.mem.ptr;
            op.body = [dp, sp, n](OpOutcome &o) {
                bulk_copy(dp, sp, n);
                o.nbytes = n;
            };
            op.keep = {d.keep, sr.keep};
            return submit(s, std::move(op), tag, cq);
        }, py::arg("dst"), py::arg("src"), py::arg("nbytes") = -1, py::kw_only(), py::arg("tag") = 0,
           py::arg("cq") = py::none())
        .def("read", [](Stream &s, std::shared_ptr<FileStore> store, py::handle k, py::handle dst,
                        bool verify, int64_t tag, py::object cq) {
            if (store->closed()) throw Error(ErrKind::Closed, "store is closed: " + store->directory());
            std::string key = store_key(k);
            BufRef d = get_buffer(dst, true);
            MemRef mem = d.mem;
            Op op;
            op.body = [store, key, mem, verify](OpOutcome &o) { o.nbytes = store->read(key, mem, verify); };
            op.keep = {d.keep};
            return submit(s, std::move(op), tag, cq);
        }, py::arg("store"), py::arg("key"), py::arg("dst"), py::kw_only(), py::arg("verify") = true,
           py::arg("tag") = 0, py::arg("cq") = py::none())
        .def("write", [](Stream &s, std::shared_ptr<FileStore> store, py::handle k, py::handle src,
                         long long nbytes, py::bytes meta, int64_t tag, py::object cq) {
            if (store->closed()) throw Error(ErrKind::Closed, "store is closed: " + store->directory());
            std::string key = store_key(k);
            BufRef b = get_buffer(src, false);
            MemRef mem = b.mem;
            mem.len = pick_len(nbytes, mem.len, "src");
            std::string mt = meta;
            Op op;
            op.body = [store, key, mem, mt](OpOutcome &o) {
                o.result = store->write(key, mem, mt);
                o.nbytes = mem.len;
            };
            op.keep = {b.keep};
            return submit(s, std::move(op), tag, cq);
        }, py::arg("store"), py::arg("key"), py::arg("src"), py::arg("nbytes") = -1, py::arg("meta") = py::bytes(""),
           py::kw_only(), py::arg("tag") = 0, py::arg("cq") = py::none())
        .def("checksum", [](Stream &s, py::handle src, long long nbytes, int64_t tag, py::object cq) {
            BufRef b = get_buffer(src, false);
            size_t n = pick_len(nbytes, b.mem.len, "src");
            const char *p = b.mem.ptr;
            Op op;
            op.body = [p, n](OpOutcome &o) {
                o.result = crc32c(p, n);
                o.nbytes = n;
            };
            op.keep = {b.keep};
            return submit(s, std::move(op), tag, cq);
        }, py::arg("src"), py::arg("nbytes") = -1, py::kw_only(), py::arg("tag") = 0, py::arg("cq") = py::none())
        .def("record", [](Stream &s, int64_t tag, py::object cq) {
            return submit(s, Op(), tag, cq);
        }, py::kw_only(), py::arg("tag") = 0, py::arg("cq") = py::none())
        .def("wait_event", [](Stream &s, Event &e) {
            drain_graveyard();
            Op op;
            op.wait_on = e.st;
            s.submit(std::move(op));
        }, py::arg("event"))
        .def("synchronize", [](Stream &s) {
            {
                py::gil_scoped_release nogil;
                s.synchronize();
            }
            drain_graveyard();
        })
        .def("query", [](Stream &s) {
            drain_graveyard();
            return s.query();
        })
        .def_property_readonly("pending", &Stream::pending)
        .def_property_readonly("name", &Stream::name)
        .def_property_readonly("native_id", &Stream::native_id)
        .def_property_readonly("closed", &Stream::closed)
        .def("close", [](Stream &s) {
            {
                py::gil_scoped_release nogil;
                s.close();
            }
            drain_graveyard();
        });

    // ------------------------------------------------------------ faults
    m.def("inject_fault", [](const std::string &op, const std::string &kind, int nth, int count, int err,
                             int delay_ms, const std::string &key_contains) {
        inject_fault(op, kind, nth, count, err, delay_ms, key_contains);
    }, py::arg("op"), py::arg("kind"), py::kw_only(), py::arg("nth") = 1, py::arg("count") = 1, py::arg("err") = EIO,
       py::arg("delay_ms") = 0, py::arg("key_contains") = "");
    m.def("clear_faults", &clear_faults);
    m.def("faults_fired", &faults_fired);
    load_faults_from_env();

    // ------------------------------------------------------------ build info
    m.def("build_info", [] {
        py::dict d;
        d["version"] = "0.1.0";
#if defined(__clang__)
        d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
        d["compiler"] = std::string("gcc ") + __VERSION__;
#else
        d["compiler"] = "unknown";
#endif
        d["cxx_std"] = std::to_string(__cplusplus);
        d["crc32c"] = std::string(crc32c_impl());
        d["bulk_copy"] = std::string(bulk_copy_impl());
        d["aio"] = aio_available();
        d["io_uring"] = io_uring_available();
        d["page_size"] = long(sysconf(_SC_PAGESIZE));
        d["o_direct_alignment"] = long(kDirectAlign);
        return d;
    });

    // Join stream workers before the interpreter goes away, then give back
    // the buffers they held.
    py::module_::import("atexit").attr("register")(py::cpp_function([] {
        std::vector<std::shared_ptr<Stream>> live;
        {
            std::lock_guard<std::mutex> g(g_streams_mu);
            for (auto &w : g_streams)
                if (auto s = w.lock()) live.push_back(s);
            g_streams.clear();
        }
        {
            py::gil_scoped_release nogil;
            for (auto &s : live) s->close();
        }
        drain_graveyard();
    }));
}
