"""What every side-channel socket shares: bounded queues and frames, no linger, and liveness
of the peer's *host* left to its kernel (keepalive, TCP_MAXRT), never to ZMTP heartbeats."""

from __future__ import annotations

import math

import zmq

__all__ = ["HOST_TIMEOUT_S", "tune_socket"]

HOST_TIMEOUT_S = 10.0
"""How long a peer's host may leave a connection unanswered before its kernel-level connection
counts as down: longer than TCP's retransmissions take on a link dropping 30 % of its packets
(3 s was not: the lossy-link row's connections broke and were redialled), short against
``heartbeat_cap_s``, the most lw waits for a silent peer whose connection stays up."""


def tune_socket(sock: zmq.Socket, hwm: int, recv_hwm: int, max_frame_bytes: int,
                host_timeout_s: float) -> None:
    """Set what every side-channel socket shares: bounded queues and frames, no linger, and a
    connection the *kernel* declares down when the peer's host stops answering."""
    sock.setsockopt(zmq.LINGER, 0)  # close never waits for a dead peer
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, recv_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    # No ZMTP heartbeats (HEARTBEAT_IVL stays 0). On libzmq 4.3.5 a heartbeat timer that fires
    # after a connection broke while its input was stopped (a full receive queue: a process
    # starved of CPU) aborts the process: ``Assertion failed: !_io_error``, seen killing D's
    # worker on loaded runs, reproduced by tests/transport/test_zmq_abort.py. Heartbeats were
    # also the wrong witness: they are answered by the peer's libzmq thread, which starves with
    # its process, while the peer's kernel keeps answering TCP. Keepalive probes find a host gone
    # while the connection is idle, TCP_MAXRT (TCP_USER_TIMEOUT) while data waits for its ack;
    # a slow process is lw's verdict to make (lw.fsm.silence), not the socket's.
    if host_timeout_s > 0:
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, max(1, math.ceil(host_timeout_s)))
        sock.setsockopt(zmq.TCP_MAXRT, max(1, round(host_timeout_s * 1000)))
