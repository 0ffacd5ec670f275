"""Scale-out on Ray: `mlc-cli deploy` (Ray Serve replicas of the server's own FastAPI app behind one endpoint, with
prefix-affinity routing), the pools that keep serving and training devices apart, and the tutorial's launcher
presets; `mlc/cluster/train.py` runs training on the pool. Ray is an optional extra (`mlc[cluster]`): the modules
a command loads before it checks for Ray import it only inside functions; `registry`, `router`, `replica` and
`gateway` run inside the cluster, where it is installed."""
