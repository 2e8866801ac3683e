"""The servicer function named in the Serve configs' ``grpc_servicer_functions``.

Serve's gRPC proxy imports it (outside any runtime_env, so this module imports only grpc, the stubs and the
key check) and calls it to learn the service's methods and how to parse their messages. It registers what the
generated ``add_HetSpecServicer_to_server`` registers, method by method from the proto's descriptor,
with one difference: a request whose bytes do not parse (invalid UTF-8 in a string field, a truncated
message) becomes an ``UndecodableRequest`` that the methods answer with INVALID_ARGUMENT; the generated
parser raised inside grpc, which answered UNKNOWN. And with $HETSPEC_API_KEY in the proxy's environment, a call
without a right key is refused in the proxy, before routing (``deployments.auth.guard_grpc_server``;
deployments/proxy.py tells how).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from deployments.auth import guard_grpc_server
from protos.hetspec.v1 import hetspec_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["HetSpec"]


@dataclass
class UndecodableRequest:
    """Bytes that are not a valid request message; ``reason`` is protobuf's."""

    reason: str


def _parser(message_class):
    def parse(raw: bytes):
        try:
            return message_class.FromString(raw)
        except DecodeError as error:
            return UndecodableRequest(str(error))

    return parse


def add_HetSpecServicer_to_server(servicer, server) -> None:  # noqa: N802 -- the generated function's name
    guard_grpc_server(server, SERVICE.full_name)  # before the handlers: Serve's server wraps them as they are added
    handlers = {}
    for method in SERVICE.methods:
        if method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client streaming is not served")
        make_handler = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                        else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make_handler(
            getattr(servicer, method.name), request_deserializer=_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
