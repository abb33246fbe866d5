"""A tiny calculator (a task of agentaccel's own for `agentaccel bench agent`)."""


def add(a, b):
    return a - b


def sub(a, b):
    return a - b
