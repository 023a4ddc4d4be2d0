// One SIGSEGV handler for Homes: it says what happened when a read of a
// detached Home kills the process, and it notices writes to attached ones.
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

// Write watches. An attached Home is mapped read-only; the first write to it
// (a kernel updating a Parameter in place: BatchNorm's running statistics in
// training mode, a KV cache held in a Parameter, an optimizer step) faults,
// and the handler makes the home writable, counts the write and lets the
// write run again. The daemon compares the count before it drops a replica it
// thinks clean, so an in-place write is written back instead of lost.
//
// watch_writes: [start, start + len) (which the caller maps PROT_READ) is
// watched; returns a slot, or -1 when the table is full (the caller must then
// treat the range as written). watch_writes also puts the handler back on top
// if another one was installed over it since.
int watch_writes(uintptr_t start, size_t len);
// Twice the write faults taken in the slot so far; odd while one is being let through.
uint64_t watched_writes(int slot);
// Stop watching; returns once no handler is inside the slot, so the caller may
// then move the pages away without the handler making the old range writable.
void unwatch_writes(int slot);

}  // namespace pfd
