"""Errors a user can meet. Each carries a message that says what to do, and maps to one exit code and HTTP status."""

from __future__ import annotations


class MlcError(Exception):
    """Base class: `str(err)` is the whole user-facing message."""

    exit_code = 1
    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class ConfigError(MlcError):
    exit_code = 2
    http_status = 400
    error_type = "invalid_request_error"


class InvalidRequestError(MlcError):
    exit_code = 2
    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(MlcError):
    exit_code = 3
    http_status = 404
    error_type = "model_not_found"


class ModelFormatError(MlcError):
    """A checkpoint that exists but cannot be read: truncated, missing files, unsupported architecture or quant."""

    exit_code = 4
    http_status = 500
    error_type = "model_format_error"


class IntegrityError(MlcError):
    exit_code = 5
    http_status = 500
    error_type = "integrity_error"


class ContextLengthError(InvalidRequestError):
    error_type = "context_length_exceeded"


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit this server (more KV pages than it holds); retrying cannot help."""

    error_type = "request_too_large"


class CapacityError(MlcError):
    """Not enough memory or queue room; the caller may retry later or lower its ask."""

    exit_code = 6
    http_status = 429
    error_type = "capacity_error"


class DiskSpaceError(CapacityError):
    """Too little free disk for a download, measured before its first byte; nothing was written."""

    error_type = "insufficient_disk"


class DeviceError(MlcError):
    exit_code = 7
    http_status = 500
    error_type = "device_error"


class AuthError(MlcError):
    exit_code = 8
    http_status = 401
    error_type = "authentication_error"


class DataError(InvalidRequestError):
    """Training or evaluation data that cannot be used: missing file, malformed rows, nothing left to train on."""

    error_type = "invalid_data"


class TrainingError(MlcError):
    """A run that cannot go on: repeated non-finite steps, an unusable checkpoint, a failed worker."""

    exit_code = 9
    error_type = "training_error"


class EngineStepError(MlcError):
    """A bug surfaced in one engine step: the requests of that step fail, the engine repairs itself and goes on."""

    http_status = 500
    error_type = "engine_error"


class EngineDeadError(MlcError):
    """The engine's state could not be repaired after a failed step: the process drains and exits non-zero."""

    http_status = 503
    error_type = "engine_error"


class ServiceUnavailableError(MlcError):
    """The server cannot take requests right now: the model is loading, or the server is shutting down."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(CapacityError):
    error_type = "queue_full"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(MlcError):
    """The request ran past --request-timeout before producing any token."""

    http_status = 504
    error_type = "timeout"


class UnsupportedFeatureError(InvalidRequestError):
    error_type = "unsupported_feature"


class NetworkError(MlcError):
    """A model hub that cannot be reached (offline mode, no route, a connection that kept dropping); what was
    downloaded is kept, and running the same command again resumes it."""

    exit_code = 11
    http_status = 503
    error_type = "network_error"


class ClusterError(MlcError):
    """A Ray cluster that cannot be used: ray not installed, an unreachable address, too few devices or a
    deployment whose replicas did not come up."""

    exit_code = 10
    http_status = 503
    error_type = "cluster_error"


class NotFoundError(MlcError):
    """A stored object (a response of /v1/responses) that this server does not hold."""

    exit_code = 3
    http_status = 404
    error_type = "not_found_error"
