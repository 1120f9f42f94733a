"""The protobuf / gRPC stubs of the wire API, committed under _proto/.

They are generated from proto/ by scripts/python-client-stubs (run it after changing a
.proto; ctest's python_client_stubs_current fails while they differ), so the installed
package needs neither protoc nor the .proto files at run time.
"""

from ._proto import attention_pb2, attention_pb2_grpc, health_pb2


def load():
    """Returns (attention_pb2, attention_pb2_grpc, health_pb2)."""
    return attention_pb2, attention_pb2_grpc, health_pb2
