"""A KEDA external scaler client, as KEDA's own calls look: gRPC (grpcio, not ferrite's
code) from KEDA's externalscaler.proto, compiled here with grpcio-tools.

    scaler_client.py OUT_DIR ADDRESS NAMESPACE NAME SIGNAL

prints one JSON object: the GetMetricSpec, GetMetrics and IsActive answers for the
ScaledObject NAMESPACE/NAME's trigger with `signal: SIGNAL`, or each call's gRPC status code
name and message when it fails.
"""

import json
import os
import sys

import grpc
from grpc_tools import protoc

out, address, namespace, name, signal = sys.argv[1:6]
proto_dir = os.path.dirname(os.path.abspath(__file__))
if not os.path.exists(os.path.join(out, "externalscaler_pb2_grpc.py")):
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}",
                      f"--grpc_python_out={out}",
                      os.path.join(proto_dir, "externalscaler.proto")])
    assert rc == 0, f"protoc: {rc}"
sys.path.insert(0, out)
import externalscaler_pb2 as pb  # noqa: E402
import externalscaler_pb2_grpc as rpc  # noqa: E402

ref = pb.ScaledObjectRef(name=name, namespace=namespace, scalerMetadata={"signal": signal})
stub = rpc.ExternalScalerStub(grpc.insecure_channel(address))


def call(f):
    try:
        return f()
    except grpc.RpcError as e:
        return {"error": e.code().name, "message": e.details()}


def spec():
    r = stub.GetMetricSpec(ref, timeout=5)
    return [{"metricName": s.metricName, "targetSize": s.targetSize,
             "targetSizeFloat": s.targetSizeFloat} for s in r.metricSpecs]


def metrics():
    r = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=signal), timeout=5)
    return [{"metricName": v.metricName, "metricValue": v.metricValue,
             "metricValueFloat": v.metricValueFloat} for v in r.metricValues]


print(json.dumps({"spec": call(spec), "metrics": call(metrics),
                  "active": call(lambda: stub.IsActive(ref, timeout=5).result)}))
