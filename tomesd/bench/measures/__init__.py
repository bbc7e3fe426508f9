"""What the loop bench measures and how it is reported: runner.py times the configurations interleaved and
fills one Row each, with ToMe's own time in a forward (own_time.py), the tokens that reach self-attention
(tokens.py) and one forward's host work (host_cost.py); flops.py counts compute on the meta device, memory.py
probes CPU peak memory in processes of their own, profiling.py lists the ops a forward spends its time on
(`--profile`), and report.py turns the rows into the printed table, the JSON file and the plot. These modules
import the kits below them, never the command above them."""
