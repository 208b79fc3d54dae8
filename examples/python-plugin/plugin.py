#!/usr/bin/env python3
"""A vkd provider plugin in Python: the example for authors who do not write Rust.

It speaks the provider protocol (providers/grpc/proto/vkd/provider/v1/provider.proto,
docs/provider-protocol.md) with grpcio from PyPI and keeps its "instances" in memory:
each Pod is an instance that runs at once on one host, `py-host`. What it shows is
the contract a real backend keeps:

- Hello: agree on the protocol version, say the name and the capabilities
  (none here: every optional call answers UNIMPLEMENTED with an Error saying so);
- fencing: the highest epoch seen per node; a create, delete or takeover with a
  lower one is refused with FAILED_PRECONDITION and an Error of kind FENCED;
- create is idempotent on the Pod UID; delete of what is gone succeeds;
- every change is a notice on the Events stream.

    python3 plugin.py --listen unix:///run/vkd/provider.sock

It listens on a Unix socket only, made 0600 in a directory no one else can write
(docs/provider-protocol.md): whoever reaches a plugin runs Pods through it. Plain
TCP is refused, as vkd refuses it; across machines a plugin would serve mutual TLS
(grpc.ssl_server_credentials(..., require_client_auth=True)).

The Python code for the protocol is generated at start from the .proto (grpcio-tools),
so the .proto stays the one contract.
"""

import argparse
import collections
import json
import os
import queue
import sys
import tempfile
import threading
import time
import uuid
from concurrent import futures

import grpc
from grpc_tools import protoc

PROTO_ROOT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "providers", "grpc", "proto"
)
PROTO = "vkd/provider/v1/provider.proto"
NAME = "python-example"
HOST = "py-host"


def generate(out_dir):
    """Compiles the protocol's .proto to Python in out_dir and imports it."""
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            PROTO,
        ]
    )
    if code != 0:
        sys.exit(f"compiling {PROTO} failed ({code})")
    sys.path.insert(0, out_dir)
    from vkd.provider.v1 import provider_pb2, provider_pb2_grpc  # noqa: E402

    return provider_pb2, provider_pb2_grpc


class Abort(
    collections.namedtuple("Abort", ("code", "details", "trailing_metadata")), grpc.Status
):
    """A status with vkd's Error in its details (grpc-status-details-bin)."""


def system_time(t):
    """A time as serde writes Rust's SystemTime."""
    secs = int(t)
    return {"secs_since_epoch": secs, "nanos_since_epoch": int((t - secs) * 1e9)}


class Plugin:
    def __init__(self, pb, pb_grpc):
        self.pb = pb
        self.lock = threading.Lock()
        self.instances = {}  # Pod UID -> Instance document
        self.epochs = {}  # node -> highest epoch seen
        self.subscribers = []  # queues of Events streams

        # The servicer: each call of the service, bound to this plugin.
        plugin = self

        class Servicer(pb_grpc.ProviderServicer):
            pass

        for call in (
            "Hello Health Capacity Admit Create Get Delete DeleteInstance Takeover List "
            "Events Logs Exec Attach PortForward StartEphemeral UpdateVolumes Stats Describe"
        ).split():
            setattr(Servicer, call, getattr(plugin, call))
        self.servicer = Servicer()

    # Errors --------------------------------------------------------------

    def abort(self, context, code, **fields):
        err = self.pb.Error(**fields)
        context.abort_with_status(
            Abort(code, err.message, (("grpc-status-details-bin", err.SerializeToString()),))
        )

    def unsupported(self, context, capability):
        self.abort(
            context,
            grpc.StatusCode.UNIMPLEMENTED,
            kind=self.pb.Error.UNSUPPORTED,
            message=f"provider {NAME} does not support {capability}",
            provider=NAME,
            capability=capability,
        )

    def fence(self, context, fence):
        """Takes the call's fence, or refuses it if the node has seen a newer one."""
        if not fence.node:
            self.abort(context, grpc.StatusCode.INVALID_ARGUMENT, message="no fence")
        with self.lock:
            current = self.epochs.get(fence.node, 0)
            if fence.epoch < current:
                self.abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    kind=self.pb.Error.FENCED,
                    message=f"fenced: node {fence.node} is at epoch {current}, "
                    f"call carried epoch {fence.epoch}",
                    node=fence.node,
                    current=current,
                    got=fence.epoch,
                )
            self.epochs[fence.node] = fence.epoch

    def notify(self, uid):
        for q in list(self.subscribers):
            q.put(uid)

    def document(self, value):
        return self.pb.Document(json=json.dumps(value).encode())

    # Calls ---------------------------------------------------------------

    def Hello(self, request, context):
        if 1 not in request.versions:
            self.abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                message=f"this plugin speaks protocol version 1; offered {list(request.versions)}",
            )
        return self.pb.HelloReply(version=1, name=NAME, capabilities=[], identity={})

    def Health(self, request, context):
        return self.pb.HealthReply(state=self.pb.HealthReply.HEALTHY)

    def Capacity(self, request, context):
        with self.lock:
            running = len(self.instances)
        host = {
            "name": HOST,
            "cpu_millis_total": 8000,
            "cpu_millis_free": 8000,
            "memory_bytes_total": 16 << 30,
            "memory_bytes_free": 16 << 30,
            "gpus": [],
            "rdma_domain": None,
            "max_pods": 110,
            "pods_running": running,
        }
        return self.document(
            {
                "hosts": [host],
                "kind": "Live",
                "observed_at": system_time(time.time()),
                "refresh_interval": {"secs": 10, "nanos": 0},
            }
        )

    def Admit(self, request, context):
        return self.pb.AdmitReply(fits=self.pb.Placement(host=HOST))

    def Create(self, request, context):
        self.fence(context, request.fence)
        try:
            spec = json.loads(request.spec.json)
            pod = spec["pod"]
            uid = pod["uid"]
        except (ValueError, KeyError, TypeError) as e:
            self.abort(context, grpc.StatusCode.INVALID_ARGUMENT, message=f"spec: {e}")
        now = system_time(time.time())
        with self.lock:
            existing = self.instances.get(uid)
            if existing is None:
                existing = {
                    "id": f"py-{uuid.uuid4().hex[:12]}",
                    "owner": {"uid": uid, "namespace": pod["namespace"], "name": pod["name"]},
                    "node": spec["node"],
                    "epoch": request.fence.epoch,
                    "phase": "Running",
                    "containers": [
                        {
                            "name": c["name"],
                            "state": {"Running": {"started_at": now}},
                            "last_termination": None,
                            "ready": True,
                            "restart_count": 0,
                            "container_id": f"py://{uid}/{c['name']}",
                            "started": True,
                        }
                        for c in spec.get("containers", [])
                    ],
                    "ip": None,
                    "host": HOST,
                    "created_at": now,
                    "started_at": now,
                    "message": None,
                }
                self.instances[uid] = existing
        self.notify(uid)
        return self.document(existing)

    def Get(self, request, context):
        with self.lock:
            found = self.instances.get(request.uid)
        if found is None:
            return self.pb.GetReply()
        return self.pb.GetReply(instance=self.document(found))

    def Delete(self, request, context):
        self.fence(context, request.fence)
        with self.lock:
            gone = self.instances.pop(request.uid, None)
        if gone is not None:
            self.notify(request.uid)
        return self.pb.Empty()

    def DeleteInstance(self, request, context):
        self.unsupported(context, "delete-instance")

    def Takeover(self, request, context):
        self.fence(context, request)
        return self.pb.Empty()

    def List(self, request, context):
        with self.lock:
            mine = [i for i in self.instances.values() if i["node"] == request.node]
        return self.document(mine)

    def Events(self, request, context):
        q = queue.Queue()
        self.subscribers.append(q)
        # The answer's headers tell vkd it is subscribed: send them now, not
        # with the first notice.
        context.send_initial_metadata(())
        try:
            while context.is_active():
                try:
                    uid = q.get(timeout=0.5)
                except queue.Empty:
                    continue
                yield self.pb.Event(changed=uid)
        finally:
            self.subscribers.remove(q)

    def Logs(self, request, context):
        self.unsupported(context, "logs")

    def Exec(self, request_iterator, context):
        self.unsupported(context, "exec")

    def Attach(self, request_iterator, context):
        self.unsupported(context, "attach")

    def PortForward(self, request_iterator, context):
        self.unsupported(context, "port-forward")

    def StartEphemeral(self, request, context):
        self.unsupported(context, "ephemeral containers")

    def UpdateVolumes(self, request, context):
        self.unsupported(context, "volume updates")

    def Stats(self, request, context):
        self.unsupported(context, "stats")

    def Describe(self, request, context):
        with self.lock:
            found = self.instances.get(request.uid)
        pairs = [] if found is None else [self.pb.DescribeReply.Pair(what="python instance", value=found["id"])]
        return self.pb.DescribeReply(pairs=pairs)


def socket_path(listen):
    """The socket's path, or exit saying why this endpoint is refused."""
    if not listen.startswith("unix:///"):
        sys.exit(
            f"--listen {listen!r}: plain TCP is refused: it authenticates no peer, and any Pod "
            "that shares the host's network reaches it (even on 127.0.0.1); use unix:///path.sock"
        )
    path = listen[len("unix://"):]
    directory = os.path.dirname(path) or "/"
    st = os.stat(directory)
    euid = os.geteuid()
    # Another user who can write the directory could replace the socket; a
    # sticky one (/tmp) lets no one remove what another made.
    if st.st_uid not in (euid, 0):
        why = f"belongs to uid {st.st_uid}, not to this process's uid {euid} or root"
    elif st.st_mode & 0o022 and not st.st_mode & 0o1000:
        who = "everyone" if st.st_mode & 0o002 else "its group"
        why = f"is writable by {who} (mode {st.st_mode & 0o7777:04o}) and not sticky"
    else:
        return path
    sys.exit(
        f"refusing to listen on {listen}: its directory {directory} {why}; put the socket in a "
        "directory only the plugin's user (or root) can write, such as /run/vkd made 0700"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="unix:///path.sock")
    args = parser.parse_args()
    path = socket_path(args.listen)
    with tempfile.TemporaryDirectory() as out:
        pb, pb_grpc = generate(out)
        plugin = Plugin(pb, pb_grpc)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_ProviderServicer_to_server(plugin.servicer, server)
        # grpcio binds the socket itself: the umask makes it 0600 from the
        # start (no moment with looser permissions); nothing else of this
        # process makes files meanwhile.
        umask = os.umask(0o177)
        try:
            server.add_insecure_port(args.listen)
            server.start()
        finally:
            os.umask(umask)
        if os.stat(path).st_mode & 0o077:
            server.stop(None)
            sys.exit(f"the socket {path} is not 0600")
        print(f"{NAME} listening on {args.listen}", flush=True)
        server.wait_for_termination()


if __name__ == "__main__":
    main()
