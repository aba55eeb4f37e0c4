"""How each kind of box looks in both renderings of a timeline (SVG and PNG): its colour, its
legend entry, and whether it is drawn thin.

A private module, apart from the rest of the drawing (_drawing.py) so each rendering names the look
of a kind in one place.
"""

from __future__ import annotations

# Compute kinds are tall boxes; communication and the step's tail are drawn thin.
COLORS = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "W": "#edc948",
    "RECV_F": "#9c755f",
    "RECV_B": "#b07aa1",
    "SEND_F": "#9c755f",
    "SEND_B": "#b07aa1",
    "TIED": "#ff9da7",
    "DP": "#e15759",
    "OPT": "#f28e2b",
}
# Kinds in the legend of both renderings (SVG and PNG), in drawing order.
LEGEND = (("F", "forward"), ("B", "backward"), ("W", "weight grad"), ("RECV_F", "P2P act"), ("RECV_B", "P2P grad"),
           ("TIED", "tied grads"), ("DP", "DP reduce"), ("OPT", "optimizer"))
OTHER_COLOR = "#bab0ac"
THIN_KINDS = frozenset({"RECV_F", "RECV_B", "SEND_F", "SEND_B"})
