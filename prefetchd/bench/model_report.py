"""`prefetchd bench model`: turning per-pass records into one case's report, and the plan's
prediction next to the measurement."""
import math
import statistics

from ..cost import model as plans
from ..backend.base import checksum_rate


def _hit_rate(host, remote):
    total = host + remote
    return host / total if total else None


def _pass_summary(record):
    loads = record.get("loads_from", {})
    nbytes = record.get("load_bytes_from", {})
    return {"seconds": record["seconds"], "rebinds": record.get("rebinds", 0),
            "reclaims": record.get("reclaims", 0), "loads_from": loads, "load_bytes_from": nbytes,
            "host_hit_rate": _hit_rate(nbytes.get("host", 0), nbytes.get("remote", 0)),
            "misses": record.get("misses"), "stall_seconds": record.get("stall_seconds", 0.0),
            "moved_bytes": record.get("moved_bytes", 0), "copied_bytes": record.get("copied_bytes", 0),
            "returned_bytes": record.get("returned_bytes", 0), "unparked_bytes": record.get("unparked_bytes", 0),
            "page_moves": record.get("page_moves", 0), "page_protects": record.get("page_protects", 0),
            "page_move_seconds": record.get("page_move_seconds", 0.0),
            "tlb_shootdowns": record.get("tlb_shootdowns", 0),
            "outputs_match": record.get("outputs_match", True)}


def median_interval(values, confidence=0.95):
    """A distribution-free interval for the median of `values` (order statistics: the
    k-th smallest to the k-th largest, k the largest rank whose binomial tail is within
    (1 - confidence) / 2), or None with too few values for that confidence (under 6 at 95%)."""
    xs, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while True:
        tail += math.comb(n, k) / 2 ** n          # P(fewer than k + 1 of n below the median)
        if tail > (1 - confidence) / 2:
            break
        k += 1
    return [xs[k - 1], xs[n - k]] if k >= 1 else None


def ratio_summary(ratios):
    """Per-round ratios as the reports give them: median, range, the 95% interval of the
    median (median_interval) and the number of rounds."""
    return {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)],
            "interval_95": median_interval(ratios), "rounds": len(ratios)}


def _paired(streamed, *baselines):
    """Round by round (passes 1..N), the streamed pass over the slowest baseline pass of the
    same round: a ratio less exposed to the machine's drift than one of two medians."""
    return ratio_summary([s / max(b) for s, *b in zip(streamed[1:], *(base[1:] for base in baselines))])


def _method_info(records, method):
    first, steady = records[0], records[1:]
    host = sum(r["load_bytes_from"]["host"] for r in steady)
    remote = sum(r["load_bytes_from"]["remote"] for r in steady)
    status = method.daemon.status()
    return {
        "first_pass_seconds": first["seconds"],
        "seconds": statistics.median(r["seconds"] for r in steady),
        "rebinds_first_pass": first["rebinds"],
        "rebinds_steady": sum(r["rebinds"] for r in steady),
        "remote_loads_first_pass": first["loads_from"]["remote"],
        "remote_loads_steady": sum(r["loads_from"]["remote"] for r in steady),
        "host_loads_steady": sum(r["loads_from"]["host"] for r in steady),
        "host_hit_rate": _hit_rate(host, remote),
        "loaded_bytes": statistics.median(sum(r["load_bytes_from"].values()) for r in steady),
        "stall_seconds": statistics.median(r["stall_seconds"] for r in steady),
        "fences": sum(r["fences"] for r in steady),
        # per steady pass: bytes into the device tier with no copy vs by copies, how many
        # of them were unparked in place, the page moves and permission changes, and
        # their wall time (fills, returns, attaches, detaches, parks, unparks)
        "moved_bytes": statistics.median(r["moved_bytes"] for r in steady),
        "unparked_bytes": statistics.median(r["unparked_bytes"] for r in steady),
        "page_moves": statistics.median(r["page_moves"] for r in steady),
        "page_protects": statistics.median(r["page_protects"] for r in steady),
        "copied_bytes_steady": sum(r["copied_bytes"] for r in steady),
        "page_move_seconds": statistics.median(r["page_move_seconds"] for r in steady),
        # machine-wide TLB-shootdown interrupts during a steady pass (the page moves' cost
        # to the computing cores; the resident pass's count is the baseline)
        "tlb_shootdowns": statistics.median(r["tlb_shootdowns"] for r in steady),
        "peak_device_bytes": status["device"]["peak"],
        "high_watermark": status["device"]["high_watermark"],
        "host_budget": status["host"]["budget"],
        "passes": [_pass_summary(r) for r in records],
    }


def case_report(case, tier, batch, host_budget, resident, resident_log, logs, methods):
    """One case at one batch size: medians over passes 1..N, pass 0 apart, checks."""
    info = {name: _method_info(logs[name], methods[name]) for name in logs}
    seconds = {"resident": statistics.median(resident[1:]),
               **{name: i["seconds"] for name, i in info.items()}}
    bound = max(seconds["resident"], seconds["io_only"])
    outputs = all(r["outputs_match"] for r in resident_log) and all(
        r.get("outputs_match", True) for name in ("on_demand", "prefetchd") for r in logs[name])
    watermark = all(i["peak_device_bytes"] <= i["high_watermark"] for i in info.values())
    rebinds = sum(i["rebinds_steady"] for i in info.values())
    report = {
        "case": case, "tier": tier, "batch": batch, "host_budget": host_budget,
        "seconds": seconds, "resident_passes": list(resident),
        "resident_tlb_shootdowns": statistics.median(r.get("tlb_shootdowns", 0) for r in resident_log[1:]),
        "first_pass": {"resident": resident[0], **{n: i["first_pass_seconds"] for n, i in info.items()}},
        "prefetchd_over_bound": seconds["prefetchd"] / bound,
        "bound": "compute" if seconds["resident"] >= seconds["io_only"] else "io",
        "speedup_over_on_demand": seconds["on_demand"] / seconds["prefetchd"],
        "prefetchd_over_resident": seconds["prefetchd"] / seconds["resident"],
        # The same two, round by round (median, range and a 95% interval of the median).
        "prefetchd_over_bound_paired": _paired([r["seconds"] for r in logs["prefetchd"]], resident,
                                               [r["seconds"] for r in logs["io_only"]]),
        "prefetchd_over_resident_paired": _paired([r["seconds"] for r in logs["prefetchd"]], resident),
        "outputs_match": outputs, "watermark_respected": watermark, "rebinds_steady": rebinds,
        **info,
    }
    # On this (cpu) backend nothing is copied into the device tier after the disk read.
    copied = sum(i["copied_bytes_steady"] for i in info.values())
    report["copied_bytes_steady"] = copied
    checks = [outputs, watermark, rebinds == 0, copied == 0]
    if case == "remote":
        # The host cache covers the model: after the first pass the disk is never read.
        checks.append(all(i["remote_loads_steady"] == 0 for i in info.values()))
    if tier == "host":
        checks.append(all(i["remote_loads_first_pass"] == 0 and i["remote_loads_steady"] == 0
                          for i in info.values()))
    report["ok"] = all(checks)
    return report


def plan_inputs(method, layer_seconds, rates, tier, resident_seconds):
    """plan.Inputs for a streamed method: its units in trace order; the daemon's own disk
    and host->device rates where the small-host and host cases measured them (else the raw
    engine's);
    per-unit compute: the resident model's median pass of this run, split over units as its
    per-layer fences split it (or by bytes). The fences are timed back to back after the
    interleaved passes, where the same compute has run up to 1.6x faster than inside them."""
    handle = method.handle
    units = [handle.units[i] for i in handle.trace if i >= 0]
    index = {id(cell): i for i, cell in enumerate(method.model)}
    total = sum(u.nbytes for u in units) or 1
    mapped = layer_seconds is not None and sum(layer_seconds) > 0 and all(
        id(c) in index for u in units for c in u.cells)
    scale = resident_seconds / sum(layer_seconds) if mapped else 0.0
    compute = [scale * sum(layer_seconds[index[id(c)]] for c in u.cells) if mapped
               else resident_seconds * u.nbytes / total for u in units]
    status = method.daemon.status()
    return plans.Inputs(unit_bytes=[u.nbytes for u in units], compute_seconds=compute,
                        disk_rate=rates.get("disk_daemon") or rates.get("disk_read"),
                        h2d_rate=rates.get("h2d_daemon") or rates["h2d_copy"],
                        high_watermark=status["device"]["high_watermark"],
                        host_budget=method.daemon.config.host_budget, root_bytes=handle.root.nbytes,
                        tier=tier, copy_contention=method.daemon.backend.copy_contention,
                        checksum_rate=checksum_rate()), mapped


def _pair(predicted, measured):
    return {"predicted": predicted, "measured": measured,
            "measured_over_predicted": measured / predicted if predicted else None}


def plan_report(methods, report, layer_seconds, rates, lookahead, tier, resident_seconds):
    inputs, from_fences = plan_inputs(methods["prefetchd"], layer_seconds, rates, tier, resident_seconds)
    estimate = methods["prefetchd"].handle.estimate
    p = plans.plan(inputs, lookahead=lookahead)
    demand = plans.plan(inputs, lookahead=0)
    auto = plans.plan(inputs)
    total = sum(inputs.unit_bytes) or 1
    cached = sum(inputs.unit_bytes[i] for i in p.host_cached)
    return {
        "compute_from_fences": from_fences,
        "units": len(inputs.unit_bytes), "compute_seconds": p.compute_seconds,
        # Compute measured alone (fences, back to back) against the resident passes of the
        # interleaved run: above 1 when the cores were busier during the run than alone.
        "resident_over_compute_profile": resident_seconds / sum(layer_seconds)
        if from_fences else None,
        "copy_contention": inputs.copy_contention, "checksum_rate": inputs.checksum_rate,
        "disk_rate": inputs.disk_rate, "h2d_rate": inputs.h2d_rate,
        "lookahead": p.lookahead, "clamped": p.clamped, "max_lookahead": p.max_lookahead,
        "auto_lookahead": auto.lookahead, "auto_pass_seconds": auto.pass_seconds, "bound": p.bound,
        "prefetchd": _pair(p.pass_seconds, report["seconds"]["prefetchd"]),
        # What the offloaded model itself predicts (handle.estimate, what lookahead="auto"
        # and `prefetchd demo` use): the same model, compute from its recording pass, and
        # transfer rates re-measured on its streamed passes, where compute runs beside them.
        # Its compute (timed in a streamed pass once refined) beside the bench's compute_seconds.
        "refined": dict(_pair(estimate.pass_seconds, report["seconds"]["prefetchd"]),
                        compute_seconds=estimate.compute_seconds, bound=estimate.bound) if estimate else None,
        "prefetchd_first_pass": _pair(p.first_pass_seconds, report["first_pass"]["prefetchd"]),
        "on_demand": _pair(demand.pass_seconds, report["seconds"]["on_demand"]),
        "host_cached_units": list(p.host_cached),
        "predicted_host_hit_rate": cached / total if tier == "remote" else 1.0,
        "measured_host_hit_rate": report["prefetchd"]["host_hit_rate"],
    }
