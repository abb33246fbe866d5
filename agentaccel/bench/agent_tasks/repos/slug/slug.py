"""Slugs for titles (a task of agentaccel's own for `agentaccel bench agent`)."""


def slugify(title):
    return "-".join(title.split())
