"""Segment primitives: the only place in raggedfn with custom autograd rules."""
