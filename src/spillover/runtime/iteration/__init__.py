"""Cyclic dataflows (FLIP-15): iteration heads, feedback edges, loop termination."""
