"""A Ray cluster of several nodes on this machine, every one on 127.0.0.1, for tests of layouts that span nodes.

`ray start` refuses a second node in Ray's local-only mode (the mode that keeps a head on loopback), so the nodes
are started the way Ray's own tests start them (`ray.cluster_utils.Cluster`), in this process. Each node gets
DEVICES units of the inference pool's resource, so that a replica's pipeline stages (a bundle of
tensor_parallel_size units each) land on different nodes when one node cannot hold two.

Run as `python -m tests.support.loopback_cluster NODES CPUS_PER_NODE DEVICES_PER_NODE`: prints `{"address": ...}`
once the nodes are up, and stops them when its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys


def main(nodes: int, cpus: float, devices: int) -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # local-only: nothing listens beyond loopback
    from ray.cluster_utils import Cluster

    args = {"num_cpus": cpus, "node_ip_address": "127.0.0.1", "resources": {"mlc_inference": devices},
            "object_store_memory": 256 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(**args)
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address}), flush=True)
    try:
        sys.stdin.read()  # until the test closes it
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
