"""SessionError: a failed session call, with the server's machine-readable reason.

The server names a refusal's reason in the gRPC status details (the trailing metadata
"grpc-status-details-bin"): a google.rpc.Status whose details hold a google.rpc.ErrorInfo of
domain "attention-service". The few fields needed are read here from the protobuf wire
format, so the client needs neither grpcio-status nor googleapis-common-protos.
"""

import contextlib
import functools
import inspect
import re

import grpc

DOMAIN = "attention-service"
_DETAILS_KEY = "grpc-status-details-bin"
_ERROR_INFO_TYPE = b"type.googleapis.com/google.rpc.ErrorInfo"
# grpc.StatusCode by number, for the error codes a stream's answers carry.
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# How a WRONG_REPLICA message names the holder (server/sessions/session_table.cc); replica
# names are DNS labels or pod names, so a name the server cut short ("...") does not match.
_HOLDER = re.compile(r'is held by replica "([A-Za-z0-9._-]+)"')
# ... and, for a session a draining replica handed over, the session and the holder's address.
_HANDED_OFF = re.compile(r'session "([^"]+)" is held by replica "[^"]+" at "([^"]+)"')
# A call is sent on to where a session was handed at most once per session, and for at most
# this many sessions of a call.
_MAX_HANDOFFS_FOLLOWED = 1024


class SessionError(grpc.RpcError):
    """A session call that failed: a grpc.RpcError (code(), details()) with
    reason: the server's machine-readable reason ("SESSION_EXPIRED", "SESSION_DROPPED",
        "SESSION_UNKNOWN", "WRONG_REPLICA", "MAX_SESSIONS", "MAX_SESSION_TOKENS",
        "KV_POOL_EXHAUSTED", "POSITION_GAP", "POSITION_CONFLICT", "PAST_RESERVATION",
        "PAST_LENGTH", "SESSION_BUSY", "SESSIONS_OFF", "CREDENTIAL_MISSING",
        "CREDENTIAL_UNKNOWN", "SESSION_OF_ANOTHER_IDENTITY", "MAX_SESSIONS_PER_IDENTITY",
        "MAX_RESERVED_TOKENS_PER_IDENTITY", ...), or None where it gave none (a
        malformed request, a deadline, an unreachable server);
    holder: for WRONG_REPLICA the name of the replica holding the session (None when its
        message does not name it whole), else None;
    session_id, holder_address: for a session a draining replica handed to `holder`, the
        session and where the holder answers (the client follows it), else None.
    A failed step of session_step_stream is yielded, not raised, and still unpacks as the
    (grpc.StatusCode, message) pair that stream yielded before."""

    def __init__(self, code, details, reason=None, trailing_metadata=()):
        super().__init__(details)
        self._code, self._details = code, details
        self._trailing_metadata = trailing_metadata
        self.reason = reason or None
        match = _HOLDER.search(details or "") if reason == "WRONG_REPLICA" else None
        self.holder = match.group(1) if match else None
        handed = _HANDED_OFF.search(details or "") if reason == "WRONG_REPLICA" else None
        self.session_id, self.holder_address = handed.groups() if handed else (None, None)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing_metadata

    def __str__(self):
        return "%s%s: %s" % (self._code, " (%s)" % self.reason if self.reason else "",
                             self._details)

    def __repr__(self):
        return "SessionError(%s, reason=%r, holder=%r, %r)" % (
            self._code, self.reason, self.holder, self._details)

    # (code, message) as session_step_stream's failed steps were before.
    def __iter__(self):
        return iter((self._code, self._details))

    def __getitem__(self, index):
        return (self._code, self._details)[index]


def from_rpc_error(error):
    """`error`, a grpc.RpcError of a session call (grpc or grpc.aio), as a SessionError."""
    metadata = tuple(error.trailing_metadata() or ())
    details = next((value for key, value in metadata if key == _DETAILS_KEY), b"")
    return SessionError(error.code(), error.details(), reason_in_status(details), metadata)


def from_stream_answer(answer):
    """The SessionError of a failed SessionStepStreamResponse."""
    code = _STATUS_CODES.get(answer.error_code, grpc.StatusCode.UNKNOWN)
    return SessionError(code, answer.error_message, answer.error_reason)


def follows_handoffs(method):
    """Makes a session method (function or coroutine, already raising SessionError) call
    again where a WRONG_REPLICA answer says a draining replica handed a session, pinning
    that session there (self.pin_session): once per session."""
    def handed(self, error, followed):
        if (error.holder_address is None or error.session_id in followed
                or len(followed) >= _MAX_HANDOFFS_FOLLOWED):
            return False
        followed.add(error.session_id)
        self.pin_session(error.session_id, error.holder_address)
        return True

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def coroutine(self, *args, **kwargs):
            followed = set()
            while True:
                try:
                    return await method(self, *args, **kwargs)
                except SessionError as error:
                    if not handed(self, error, followed):
                        raise

        return coroutine

    @functools.wraps(method)
    def function(self, *args, **kwargs):
        followed = set()
        while True:
            try:
                return method(self, *args, **kwargs)
            except SessionError as error:
                if not handed(self, error, followed):
                    raise

    return function


@contextlib.contextmanager
def _converted():
    try:
        yield
    except SessionError:
        raise
    except grpc.RpcError as error:
        raise from_rpc_error(error) from error


def raises_session_errors(method):
    """Makes a session method (function, generator, coroutine or async generator) raise
    SessionError for grpc.RpcError."""
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def coroutine(*args, **kwargs):
            with _converted():
                return await method(*args, **kwargs)
        return coroutine
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def async_generator(*args, **kwargs):
            with _converted():
                async for item in method(*args, **kwargs):
                    yield item
        return async_generator
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def generator(*args, **kwargs):
            with _converted():
                yield from method(*args, **kwargs)
        return generator

    @functools.wraps(method)
    def function(*args, **kwargs):
        with _converted():
            return method(*args, **kwargs)
    return function


def reason_in_status(data):
    """The reason of the attention-service ErrorInfo in a serialized google.rpc.Status, or
    None (no details, another domain, or bytes that do not parse)."""
    try:
        for number, any_bytes in _fields(data):
            if number != 3:  # Status.details, repeated Any
                continue
            any_fields = dict(_fields(any_bytes))  # Any: type_url 1, value 2
            if any_fields.get(1) != _ERROR_INFO_TYPE:
                continue
            info = dict(_fields(any_fields.get(2, b"")))  # ErrorInfo: reason 1, domain 2
            if info.get(2) == DOMAIN.encode() and info.get(1):
                return info[1].decode()
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
        pass
    return None


def _fields(data):
    """(field number, value) of a protobuf message's fields: ints for varints, bytes for
    length-delimited and fixed-width fields. ValueError on malformed bytes."""
    data, position = bytes(data), 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _varint(data, position)
        elif wire_type in (1, 2, 5):
            size = {1: 8, 5: 4}.get(wire_type)
            if size is None:
                size, position = _varint(data, position)
            value, position = data[position:position + size], position + size
            if position > len(data):
                raise ValueError("a field runs past the message")
        else:
            raise ValueError("wire type %d" % wire_type)  # groups: none in these messages
        yield number, value


def _varint(data, position):
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("a varint runs past the message")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position
