// The compute-fence block: 64 bytes shared by the fence kernel (native/kernels/
// compute_fence.cc, run by MindSpore's executor), the compute marker that queues
// it, and the completion queue the scheduler thread sleeps on. Owned by the
// queue; the marker's word tensor views it, so a fence still queued when the
// daemon closes writes memory that is still there.
//
//   int64 at byte 0   count    fences run so far: the kernel adds 1 per run and
//                              FUTEX_WAKEs the low half (ComputeMarker.wait)
//   int64 at byte 8   wake_at  0, or the count at which the kernel rings the
//                              doorbell; the waiter raises it, the queue's wait
//                              clears it once reached (it fires once)
//   int32 at byte 16  doorbell a futex counter the kernel and the queue's
//                              push/notify add 1 to and wake; the queue's wait
//                              sleeps on it (an eventcount: read it, check, sleep
//                              only while it is unchanged, so no ring is lost)
//
// Header-only and dependency-free: the kernel is a separate library and includes it too.
#pragma once

#include <cstdint>

namespace pfd::fence_block {

constexpr int kCount = 0;      // int64 index
constexpr int kWakeAt = 1;     // int64 index
constexpr int kDoorbell = 4;   // int32 index (byte 16)
constexpr int kBytes = 64;

inline int64_t *words(void *block) { return static_cast<int64_t *>(block); }
inline uint32_t *doorbell(void *block) { return static_cast<uint32_t *>(block) + kDoorbell; }

}  // namespace pfd::fence_block
