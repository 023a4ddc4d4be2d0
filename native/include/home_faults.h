// Says what happened when a read of a detached Home kills the process.
//
// A Home whose tensor is not resident is PROT_NONE: a framework kernel that
// reads it (a functional op on a managed Parameter outside a forward or
// daemon.use) dies with SIGSEGV in native code, where no Python error can be
// raised. A SIGSEGV handler checks whether the fault address lies in a
// VirtualRange; if so it writes one line to stderr saying so, then hands the
// fault on to the handler installed before it (Python's faulthandler, which
// then prints the Python stack) or the default action. The process still
// dies: the read happened inside a kernel that cannot be resumed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pfd {

// Registers [start, start + len); the handler is installed on the first call.
// Returns a slot for unregister_home_range, or -1 when the table is full (the
// range then dies without the line).
int register_home_range(uintptr_t start, size_t len);
void unregister_home_range(int slot);

}  // namespace pfd
