"""PREFETCHD_* environment variables: the prefix settings are read under, the variables
of that prefix that are no settings, and a warning for the rest (a misspelled setting
would otherwise be ignored without a word)."""
import difflib
import logging

ENV_PREFIX = "PREFETCHD_"
# PREFETCHD_* variables read elsewhere, not settings: the config file, the CLI's log level,
# bench accelerate's interpreter, the native engine's fault injection and a property
# test's size (tests), CI's venv.
OTHER_ENV = frozenset(ENV_PREFIX + n for n in ("CONFIG", "LOG_LEVEL", "TORCH_PYTHON", "FAULTS", "VENV",
                                               "HYPOTHESIS_EXAMPLES"))

log = logging.getLogger("prefetchd.config")
_warned_env = set()


def warn_unknown_env(env, keys):
    """A misspelled setting (PREFETCHD_LOOKAHAED) would be ignored without a word: say so,
    once per name, with the setting it is closest to."""
    settings = {ENV_PREFIX + k.upper() for k in keys}
    for name in env:
        if not name.upper().startswith(ENV_PREFIX) or name in settings or name in OTHER_ENV or name in _warned_env:
            continue
        _warned_env.add(name)
        close = [name.upper()] if name.upper() in settings else difflib.get_close_matches(name, sorted(settings), n=1)
        log.warning("%s is not a prefetchd setting and is ignored%s", name,
                    f" (did you mean {close[0]}?)" if close else "")
