"""gRPC server reflection, as `grpc.reflection.v1` (what current tools ask first: grpcurl, yagrc, Postman) and as
`grpc.reflection.v1alpha` (older tools).

grpcio-reflection implements only v1alpha. The v1 protocol is the same messages with the same field numbers in
another package (grpc/reflection/v1/reflection.proto was v1alpha's file promoted), so one servicer answers both
services, its messages being identical on the wire. Reflection reads its own descriptor pool, which holds the
served files and a v1 copy of the reflection file (renamed package): the process-wide default pool is left alone,
so a client library that registers its own v1 file in the same process cannot clash with ours.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_METHOD = "ServerReflectionInfo"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, made from v1alpha's file: same messages, package grpc.reflection.v1."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = "grpc.reflection.v1alpha", "grpc.reflection.v1"
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", new
    proto.options.Clear()
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # only message fields have one (assigning "" would set it)
                field.type_name = field.type_name.replace(f".{old}.", f".{new}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    return proto


def _pool(files: Iterable[FileDescriptor]) -> descriptor_pool.DescriptorPool:
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(fd: FileDescriptor) -> None:
        if fd.name in added:
            return
        for dep in fd.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        pool.Add(proto)
        added.add(fd.name)

    for fd in files:
        add(fd)
    add(reflection_pb2.DESCRIPTOR)
    pool.Add(_v1_file())
    return pool


def enable(server: grpc.Server, services: dict[str, FileDescriptor]) -> None:
    """Serve reflection v1 and v1alpha on `server` for `services` (full name -> the file that defines it)."""
    pool = _pool(services.values())
    servicer = reflection.ReflectionServicer([*services, V1, V1ALPHA], pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1, V1ALPHA):
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(name, {_METHOD: handler})])
