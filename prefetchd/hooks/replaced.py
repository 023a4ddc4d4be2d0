"""Parameters replaced after offload(): `cell.weight = Parameter(...)` (mindone's Speech2Text
regrows its position table that way in its forward) puts a Parameter prefetchd does not
manage where a managed one was. The cell computes with the new one, resident in RAM outside
device_budget, while the old one, no longer read, still streams with its unit. Refusing the
replacement would break such models, so each is logged once, at the end of the pass that
made it, saying what it costs and how to stream the new values instead.
"""
import logging

log = logging.getLogger("prefetchd.hooks")


class ReplacedParams:
    """Where each managed Parameter sits (its cell's parameter table and attribute name),
    checked at every pass end: one dict lookup per parameter."""

    def __init__(self, model, managed):
        ids = {id(p) for p in managed}
        self._slots = [(f"{path}.{name}" if path else name, cell._params, name, p)
                       for path, cell in model.cells_and_names()
                       for name, p in list(cell._params.items()) if p is not None and id(p) in ids]

    def check(self):
        """Log each parameter replaced (or set to None) since the last check, once."""
        replaced = [slot for slot in self._slots if slot[1].get(slot[2]) is not slot[3]]
        if not replaced:
            return
        for path, table, name, _ in replaced:
            now = table.get(name)
            what = "set to None" if now is None else \
                f"replaced by a Parameter prefetchd does not manage ({now.nbytes} bytes in RAM, outside device_budget)"
            log.warning("prefetchd.offload: %r was %s after offload(); the offloaded one is no longer read "
                        "but still streams with its unit. To stream new values, load them with "
                        "prefetchd.load_param_into_net; to stream the new Parameter, close the handle and "
                        "offload the model again", path, what)
        self._slots = [slot for slot in self._slots if all(slot is not r for r in replaced)]
