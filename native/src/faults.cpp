// Fault injection: a small rule list behind a mutex, with an atomic fast path
// so the store pays one relaxed load per operation when no fault is armed.
#include "faults.h"

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <vector>

#include "common.h"

namespace pfd {
namespace {

struct Rule {
    std::string op;
    FaultKind kind;
    long nth, count;
    int err, delay_ms;
    std::string key_contains;
    long seen = 0;
};

std::mutex g_mu;
std::vector<Rule> g_rules;
std::atomic<bool> g_armed{false};
std::atomic<long> g_fired{0};

FaultKind parse_kind(const std::string &k) {
    if (k == "error") return FaultKind::Error;
    if (k == "short") return FaultKind::Short;
    if (k == "bitflip") return FaultKind::Bitflip;
    if (k == "delay") return FaultKind::Delay;
    throw Error(ErrKind::Value, "unknown fault kind '" + k + "' (error|short|bitflip|delay)");
}

int parse_errno(const std::string &v) {
    static const char *names[] = {"EIO", "ENOSPC", "EFBIG", "EINVAL", "ENOMEM", "EDQUOT", "EROFS", "EAGAIN", "EINTR"};
    static const int vals[] = {EIO, ENOSPC, EFBIG, EINVAL, ENOMEM, EDQUOT, EROFS, EAGAIN, EINTR};
    for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++)
        if (v == names[i]) return vals[i];
    return std::stoi(v);
}

}  // namespace

void inject_fault(const std::string &op, const std::string &kind, int nth, int count, int err, int delay_ms,
                  const std::string &key_contains) {
    if (op != "read" && op != "write") throw Error(ErrKind::Value, "fault op must be 'read' or 'write', got '" + op + "'");
    if (nth < 1 || count < 1) throw Error(ErrKind::Value, "fault nth and count must be >= 1");
    if (err <= 0) throw Error(ErrKind::Value, "fault err must be a positive errno");
    Rule r{op, parse_kind(kind), nth, count, err, delay_ms, key_contains};
    std::lock_guard<std::mutex> g(g_mu);
    g_rules.push_back(r);
    g_armed = true;
}

void clear_faults() {
    std::lock_guard<std::mutex> g(g_mu);
    g_rules.clear();
    g_armed = false;
    g_fired = 0;
}

long faults_fired() { return g_fired.load(); }

static void load_faults(const char *env);

// What a refusal of PREFETCHD_FAULTS adds: the format, and that it is a test switch.
static const char *const kFaultsFormat =
    " (PREFETCHD_FAULTS injects storage faults for tests: entries OP:KIND[:nth=N][:count=N][:err=E]"
    "[:delay_ms=N][:key=S] separated by ';', e.g. read:error:nth=3:err=5; unset it to run normally)";

void load_faults_from_env() {
    const char *env = getenv("PREFETCHD_FAULTS");
    if (!env || !*env) return;
    try {
        load_faults(env);
    } catch (const Error &e) {
        throw Error(ErrKind::Value, std::string(e.what()) + kFaultsFormat);
    }
}

static void load_faults(const char *env) {
    std::stringstream all(env);
    std::string spec;
    while (std::getline(all, spec, ';')) {
        if (spec.empty()) continue;
        std::stringstream parts(spec);
        std::string tok;
        std::vector<std::string> f;
        while (std::getline(parts, tok, ':')) f.push_back(tok);
        if (f.size() < 2) throw Error(ErrKind::Value, "PREFETCHD_FAULTS: bad entry '" + spec + "'");
        int nth = 1, count = 1, err = EIO, delay = 0;
        std::string key;
        for (size_t i = 2; i < f.size(); i++) {
            auto eq = f[i].find('=');
            if (eq == std::string::npos) throw Error(ErrKind::Value, "PREFETCHD_FAULTS: bad option '" + f[i] + "'");
            std::string k = f[i].substr(0, eq), v = f[i].substr(eq + 1);
            try {
                if (k == "nth") nth = std::stoi(v);
                else if (k == "count") count = std::stoi(v);
                else if (k == "err") err = parse_errno(v);
                else if (k == "delay_ms") delay = std::stoi(v);
                else if (k == "key" || k == "key_contains") key = v;
                else throw Error(ErrKind::Value, "PREFETCHD_FAULTS: unknown option '" + k + "'");
            } catch (const std::logic_error &) {
                throw Error(ErrKind::Value, "PREFETCHD_FAULTS: bad value in '" + f[i] + "'");
            }
        }
        inject_fault(f[0], f[1], nth, count, err, delay, key);
    }
}

FaultAction check_fault(const char *op, const std::string &key) {
    FaultAction a;
    if (!g_armed.load(std::memory_order_relaxed)) return a;
    std::lock_guard<std::mutex> g(g_mu);
    for (auto &r : g_rules) {
        if (r.op != op) continue;
        if (!r.key_contains.empty() && key.find(r.key_contains) == std::string::npos) continue;
        long n = ++r.seen;
        if (n >= r.nth && n < r.nth + r.count && a.kind == FaultKind::None) {
            a.kind = r.kind;
            a.err = r.err;
            a.delay_ms = r.delay_ms;
            g_fired++;
        }
    }
    return a;
}

}  // namespace pfd
