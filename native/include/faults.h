// Test-only fault injection, consulted once per store read/write operation.
#pragma once

#include <string>

namespace pfd {

enum class FaultKind { None, Error, Short, Bitflip, Delay };

struct FaultAction {
    FaultKind kind = FaultKind::None;
    int err = 0;
    int delay_ms = 0;
};

void inject_fault(const std::string &op, const std::string &kind, int nth, int count, int err, int delay_ms,
                  const std::string &key_contains);
void clear_faults();
long faults_fired();
// Parse PREFETCHD_FAULTS ("read:error:nth=3:err=5;write:short:nth=1"); throws Error(Value) on junk.
void load_faults_from_env();
// Called by the store at the start of each operation; cheap when nothing is armed.
FaultAction check_fault(const char *op, const std::string &key);

}  // namespace pfd
