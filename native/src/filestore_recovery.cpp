// FileStore: the directory lock, recovery at open, and quarantine.
//
// Recovery trusts nothing in the directory: it looks at names first (lstat),
// opens only regular files and never blocks on one (O_NONBLOCK|O_NOFOLLOW: a
// FIFO or a symlink named *.pfd cannot hang or redirect it), and moves what it
// cannot use into quarantine/ instead of deleting it.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common.h"
#include "crc32c.h"
#include "filestore.h"
#include "filestore_format.h"

namespace pfd {

using namespace fmt;

uint64_t fmt::version_in_name(const std::string &n) {
    size_t last = n.rfind('.');
    if (last == std::string::npos || last < 17 || n[last - 17] != '.') return 0;
    uint64_t v = 0;
    for (size_t i = last - 16; i < last; i++) {
        char c = n[i];
        int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (d < 0) return 0;
        v = v * 16 + uint64_t(d);
    }
    return v;
}

namespace {

const char *file_kind(mode_t m) {
    if (S_ISDIR(m)) return "directory";
    if (S_ISFIFO(m)) return "fifo";
    if (S_ISLNK(m)) return "symlink";
    if (S_ISSOCK(m)) return "socket";
    if (S_ISCHR(m)) return "character device";
    if (S_ISBLK(m)) return "block device";
    return "regular file";
}

// Keys come back to Python as str: a header whose key is not UTF-8 is unusable.
bool valid_utf8(const std::string &s) {
    size_t i = 0, n = s.size();
    while (i < n) {
        unsigned char c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        if (len == 0 || i + len > n) return false;
        uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
        for (size_t k = 1; k < len; k++) {
            unsigned char cc = s[i + k];
            if ((cc >> 6) != 0x2) return false;
            cp = (cp << 6) | (cc & 0x3F);
        }
        static const uint32_t min_for_len[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_for_len[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += len;
    }
    return true;
}

long read_pid(int fd) {
    char buf[32] = {};
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    return n > 0 ? strtol(buf, nullptr, 10) : 0;
}

}  // namespace

// ---------------------------------------------------------------- lock

void FileStore::lock_directory() {
    const std::string lock_path = dir_ + "/" + kLockName;
    // Retried when the lock file is replaced under us (a failed open removing
    // the one it created, or a hard-linked copy being replaced: see below).
    for (int attempt = 0; attempt < 16; attempt++) {
        bool created = true;
        int fd = openat(dir_fd_, kLockName, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST) {
            created = false;
            fd = openat(dir_fd_, kLockName, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        }
        if (fd < 0) {
            int err = errno;
            if (err == ENOENT) continue;
            throw Error(ErrKind::IOFailure, "store directory " + dir_ + " is not writable: cannot open its lock file " +
                                                lock_path + ": " + errno_name(err), err);
        }
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            ::close(fd);
            throw Error(ErrKind::IOFailure, "cannot lock store directory " + dir_ + ": " + lock_path +
                                                " is not a regular file");
        }
        if (st.st_nlink > 1) {
            // Hard-linked from another directory (a staging copy of this store):
            // sharing its inode would share its lock. Take a file of our own.
            unlinkat(dir_fd_, kLockName, 0);
            ::close(fd);
            continue;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int err = errno;
            long pid = err == EWOULDBLOCK ? read_pid(fd) : 0;
            ::close(fd);
            if (err != EWOULDBLOCK)
                throw Error(ErrKind::IOFailure, "cannot lock store directory " + dir_ + ": flock " + lock_path + ": " +
                                                    errno_name(err), err);
            std::string who = pid > 0 ? "pid " + std::to_string(pid) : "another process (pid not recorded yet)";
            if (pid == long(getpid())) who += " (this process: close the FileStore already open there first)";
            throw StoreInUse("store " + dir_ + " is in use by " + who, pid);
        }
        struct stat now;
        if (fstatat(dir_fd_, kLockName, &now, AT_SYMLINK_NOFOLLOW) != 0 || now.st_ino != st.st_ino ||
            now.st_dev != st.st_dev) {
            ::close(fd);  // unlinked or replaced between our open and our flock
            continue;
        }
        std::string pid = std::to_string(getpid()) + "\n";
        if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) != ssize_t(pid.size())) {
            int err = errno;
            if (created) unlinkat(dir_fd_, kLockName, 0);
            ::close(fd);
            throw Error(ErrKind::IOFailure, "store directory " + dir_ + " is not writable: writing " + lock_path +
                                                ": " + errno_name(err), err);
        }
        lock_fd_ = fd;
        created_lock_ = created;
        return;
    }
    throw Error(ErrKind::IOFailure, "cannot lock store directory " + dir_ + ": " + lock_path + " keeps being replaced");
}

void FileStore::release_directory(bool failed_open) {
    if (lock_fd_ >= 0) {
        if (failed_open && created_lock_) unlinkat(dir_fd_, kLockName, 0);  // still locked: nobody else uses it
        ::close(lock_fd_);
        lock_fd_ = -1;
    }
    if (dir_fd_ >= 0) ::close(dir_fd_);
    dir_fd_ = -1;
    if (failed_open && created_dir_) rmdir(dir_.c_str());  // only if still empty
}

// ---------------------------------------------------------------- quarantine

std::string FileStore::quarantine(const std::string &name, const std::string &why, RecoveryReport &rep) {
    Quarantined q{dir_ + "/" + name, "", why};
    struct stat st;
    if (mkdirat(dir_fd_, kQuarantineDir, 0700) != 0 && errno != EEXIST) {
        q.reason += " (left in place: cannot create " + dir_ + "/" + kQuarantineDir + ": " + errno_name(errno) + ")";
    } else if (fstatat(dir_fd_, kQuarantineDir, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) {
        q.reason += std::string(" (left in place: ") + dir_ + "/" + kQuarantineDir + " is not a directory)";
    } else {
        for (int i = 0; i < 1000; i++) {  // never overwrite an earlier quarantined file of the same name
            std::string target = std::string(kQuarantineDir) + "/" + name + (i ? "." + std::to_string(i) : "");
            if (fstatat(dir_fd_, target.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) continue;
            if (renameat(dir_fd_, name.c_str(), dir_fd_, target.c_str()) == 0) q.moved_to = dir_ + "/" + target;
            else q.reason += " (left in place: rename: " + errno_name(errno) + ")";
            break;
        }
    }
    rep.quarantined.push_back(q);
    return q.moved_to;
}

// ---------------------------------------------------------------- parsing

// The entry a version file's header describes; nullptr with `why` set when it
// is unusable, nullptr with `why` empty when the name vanished meanwhile.
std::shared_ptr<Entry> FileStore::parse_file(const std::string &name, std::string &why) const {
    struct stat st;
    if (fstatat(dir_fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno != ENOENT) why = "lstat: " + errno_name(errno);
        return nullptr;
    }
    if (!S_ISREG(st.st_mode)) {
        why = std::string("not a regular file (") + file_kind(st.st_mode) + ")";
        return nullptr;
    }
    int fd = openat(dir_fd_, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        if (errno != ENOENT) why = "open: " + errno_name(errno);
        return nullptr;
    }
    std::string h(kDirectAlign, '\0');
    std::shared_ptr<Entry> e;
    do {
        if (fstat(fd, &st) != 0) { why = "fstat: " + errno_name(errno); break; }
        if (!S_ISREG(st.st_mode)) { why = std::string("not a regular file (") + file_kind(st.st_mode) + ")"; break; }
        if (st.st_mode & 077) fchmod(fd, st.st_mode & 0700);  // written by an older build with 0644
        ssize_t got = full_io(false, fd, &h[0], h.size(), 0);
        if (got < ssize_t(kFixed)) { why = "truncated header"; break; }
        if (memcmp(h.data(), kMagic, 4) != 0) { why = "bad magic"; break; }
        uint32_t format = get<uint32_t>(&h[4]);
        if (format != kFormat) {
            why = "format version " + std::to_string(format) +
                  (format > kFormat ? " is newer than this build reads (" + std::to_string(kFormat) + ")"
                                    : " is unknown");
            break;
        }
        size_t hsize = get<uint32_t>(&h[8]), klen = get<uint32_t>(&h[12]), nex = get<uint32_t>(&h[40]),
               mlen = get<uint32_t>(&h[44]);
        if (klen == 0 || klen > kMaxKeyBytes || mlen > kMaxMeta || hsize != header_size_for(klen, mlen, nex)) {
            why = "bad header sizes";
            break;
        }
        if (hsize > h.size()) {
            if (hsize > uint64_t(st.st_size)) { why = "truncated header"; break; }  // before allocating it
            h.resize(hsize);
            if (full_io(false, fd, &h[0], hsize, 0) != ssize_t(hsize)) { why = "truncated header"; break; }
        }
        size_t at = kFixed + klen + mlen + 4 * nex;
        if (get<uint32_t>(&h[at]) != crc32c(h.data(), at)) { why = "header checksum mismatch"; break; }
        e = std::make_shared<Entry>();
        e->nbytes = get<uint64_t>(&h[16]);
        e->version = get<uint64_t>(&h[24]);
        e->extent_size = get<uint64_t>(&h[32]);
        e->data_crc = get<uint32_t>(&h[48]);
        e->key.assign(&h[kFixed], klen);
        e->meta.assign(&h[kFixed + klen], mlen);
        e->crcs.resize(nex);
        if (nex) memcpy(e->crcs.data(), &h[kFixed + klen + mlen], 4 * nex);
        e->header_size = hsize;
        e->path = dir_ + "/" + name;
        // Bounded by the file before any arithmetic on it (a crafted nbytes near 2^64 wrapped the
        // checks below into agreeing, and a bogus newest version won over the real one).
        if (e->nbytes > uint64_t(st.st_size)) { why = "data size beyond the file"; e.reset(); break; }
        const uint64_t named = version_in_name(name);
        if (e->version >= kMaxVersion || (named != 0 && named != e->version)) {
            why = "version " + std::to_string(e->version) + " is not one a store writes, or not its file name's";
            e.reset();
            break;
        }
        if (e->extent_size == 0 || n_extents(e->nbytes, e->extent_size) != nex) { why = "bad extent table"; e.reset(); break; }
        if (!valid_utf8(e->key)) { why = "key is not valid UTF-8"; e.reset(); break; }
        uint64_t want = hsize + round_up(e->nbytes, kDirectAlign);
        if (uint64_t(st.st_size) != want) {
            why = "size " + std::to_string(st.st_size) + " does not match its header (" + std::to_string(want) + ")";
            e.reset();
            break;
        }
    } while (false);
    ::close(fd);
    return e;
}

bool FileStore::verify_file(const Entry &e, std::string &why) const {
    int fd = open(e.path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) { why = "open: " + errno_name(errno); return false; }
    std::vector<char> buf(size_t(std::min<uint64_t>(e.extent_size, 64 << 20)));
    bool ok = true;
    for (size_t i = 0; ok && i < e.crcs.size(); i++) {
        uint64_t off = i * e.extent_size, len = std::min(e.extent_size, e.nbytes - off), done = 0;
        uint32_t c = 0;
        while (done < len) {  // extents larger than the buffer are checksummed in pieces
            size_t n = size_t(std::min<uint64_t>(buf.size(), len - done));
            if (full_io(false, fd, buf.data(), n, e.header_size + off + done) != ssize_t(n)) {
                why = "read error in extent " + std::to_string(i);
                ok = false;
                break;
            }
            c = crc32c(buf.data(), n, c);
            done += n;
        }
        if (ok && c != e.crcs[i]) { why = "checksum mismatch in extent " + std::to_string(i); ok = false; }
    }
    ::close(fd);
    return ok;
}

// ---------------------------------------------------------------- recovery

RecoveryReport FileStore::recover(bool verify_data) {
    RecoveryReport rep;
    std::lock_guard<std::mutex> g(mu_);
    DIR *d = opendir(dir_.c_str());
    if (!d) throw Error(ErrKind::IOFailure, "cannot list store directory " + dir_ + ": " + errno_name(errno), errno);
    std::map<std::string, std::vector<std::shared_ptr<Entry>>> found;
    std::vector<std::string> names;
    while (dirent *de = readdir(d)) names.push_back(de->d_name);
    closedir(d);
    uint64_t max_version = 0;
    for (auto &n : names) {
        if (n.rfind(kProbePrefix, 0) == 0 || n == kLockName) continue;  // a live probe; the lock
        const uint64_t named = version_in_name(n);
        if (named < kMaxVersion) max_version = std::max(max_version, named);
        std::string path = dir_ + "/" + n;
        if (ends_with(n, ".tmp")) {
            if (writing_.count(path)) continue;  // our own write in progress
            struct stat st;
            if (fstatat(dir_fd_, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
            if (!S_ISREG(st.st_mode))
                quarantine(n, std::string("not a regular file (") + file_kind(st.st_mode) + ")", rep);
            else if (unlinkat(dir_fd_, n.c_str(), 0) == 0)
                rep.removed_tmp.push_back(path);  // a torn write of ours
        } else if (ends_with(n, ".pfd")) {
            std::string why;
            auto e = parse_file(n, why);
            if (!e) {
                if (!why.empty()) quarantine(n, why, rep);
                continue;
            }
            max_version = std::max(max_version, e->version);
            found[e->key].push_back(e);
        }
    }
    // Per key, the newest usable version. Two or more versions on disk mean the
    // newest was never verified (a commit deletes the older one): its data is
    // checked now, so an unverified write that went bad falls back to the last
    // good version instead of being served.
    std::map<std::string, Slot> index;
    for (auto &kv : found) {
        auto &v = kv.second;
        std::sort(v.begin(), v.end(), [](auto &a, auto &b) { return a->version > b->version; });
        const bool check = verify_data || v.size() > 1;
        std::shared_ptr<const Entry> chosen;
        for (auto &e : v) {
            if (chosen) {
                if (unlink(e->path.c_str()) == 0) rep.removed_old++;
                continue;
            }
            std::string why;
            if (check && !verify_file(*e, why)) {
                quarantine(e->path.substr(dir_.size() + 1), why, rep);
                continue;
            }
            chosen = e;
        }
        // The only copy left is the last good one as far as anyone can tell.
        if (chosen) index[kv.first] = Slot{chosen, true, nullptr};
    }
    index_ = std::move(index);
    rep.kept = long(index_.size());
    if (max_version + 1 > next_version_) next_version_ = max_version + 1;
    if (dir_fd_ >= 0) fsync(dir_fd_);
    return rep;
}

}  // namespace pfd
