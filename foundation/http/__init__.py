"""The HTTP pieces the gateway and every replica share: the error shape, the names on their wire, the body limit,
the guard against slow clients, the launch token, and work that stops when its client leaves."""
