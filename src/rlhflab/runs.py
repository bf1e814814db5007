"""Old name, kept importable: serialisation and redaction are `rlhflab.serialize`, the run
directory is `rlhflab.rundir`."""

from rlhflab.rundir import SampleWriter, check_run_name, create_run_dir, is_run_of
from rlhflab.serialize import (
    NONFINITE_NOTES,
    REDACTED,
    decode_nonfinite,
    encode_nonfinite,
    finite_json,
    is_secret_name,
    redact,
    redact_json,
    redact_obj,
    secret_values,
    to_json,
    write_json_atomic,
    write_text_atomic,
    write_yaml_atomic,
)

__all__ = [
    "NONFINITE_NOTES",
    "REDACTED",
    "SampleWriter",
    "check_run_name",
    "create_run_dir",
    "decode_nonfinite",
    "encode_nonfinite",
    "finite_json",
    "is_run_of",
    "is_secret_name",
    "redact",
    "redact_json",
    "redact_obj",
    "secret_values",
    "to_json",
    "write_json_atomic",
    "write_text_atomic",
    "write_yaml_atomic",
]
