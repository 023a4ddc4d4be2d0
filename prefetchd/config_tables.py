"""The layout of a prefetchd TOML file: the daemons' settings in a [prefetchd] table (or
at the top level of a file without one) and `prefetchd serve`'s in [serve]. A table of
another name (a misspelled [prefetch]) or top-level keys beside a [prefetchd] table were
ignored without a word; they are refused, naming the file, the closest table and where
the keys belong (a PREFETCHD_* variable that is no setting is warned about: the
environment is shared with other programs, a prefetchd config file is not)."""
import difflib

from .errors import ConfigError

TABLES = ("prefetchd", "serve")


def _is_table(value):
    return isinstance(value, dict) or (isinstance(value, list) and bool(value)
                                       and all(isinstance(v, dict) for v in value))


def check_tables(doc, path):
    """ConfigError if the parsed TOML `doc` of file `path` holds what no reader reads."""
    flat = [k for k in TABLES if k in doc and not isinstance(doc[k], dict)]
    if flat:        # `serve = 3`, or [[serve]] (an array of tables): read as an unknown setting
        raise ConfigError(f"config file {path}: {flat[0]} is not a table: write [{flat[0]}] on a line of "
                          f"its own with its settings below it (not {flat[0]} = ..., nor [[{flat[0]}]])")
    unknown = [k for k, v in doc.items() if _is_table(v) and k not in TABLES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], TABLES, n=1)
        raise ConfigError(f"config file {path}: unknown table [{unknown[0]}]"
                          + (f" (did you mean [{close[0]}]?)" if close else "")
                          + "; prefetchd reads [prefetchd] and [serve] only")
    loose = [k for k, v in doc.items() if not _is_table(v) and k not in TABLES]
    if loose and "prefetchd" in doc:
        raise ConfigError(f"config file {path}: {', '.join(loose[:8])} outside the [prefetchd] table "
                          f"would be ignored (a file with a [prefetchd] table is read from it "
                          f"alone): move {'it' if len(loose) == 1 else 'them'} into [prefetchd]")
