"""`mlc-cli plan`: a deployment's memory, layout and speed from a model's shape and the hardware, before anything
runs (`planner.plan`), with advice; `model_facts` and `shapes` describe models by their configs or known shapes."""
