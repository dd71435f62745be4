"""Sockets that gRPC owns, looked at and acted on from beside it, for the connection guard (serving/guard.py): the
kernel's side, with no policy. Every action works on a duplicate of gRPC's descriptor whose inode is checked first
(`dup_socket`): gRPC may close a descriptor at any time and its number then names another file.

- `peer_on(fd, ports)`: whose connection a descriptor is (or that it is a listening socket of `ports`);
- `counters(fd, inode)`: TCP_INFO's bytes the peer took and bytes received, of an established connection;
- `cut_socket(fd, inode)`: a socket filter that drops every incoming segment carrying data (acknowledgements and
  FIN still pass, so the close completes), shutdown both ways, then what the kernel had queued for gRPC discarded
  unread (a flood's backlog: up to the receive buffer, megabytes, that gRPC would otherwise still read, decrypt and
  answer): gRPC sees the end and closes the connection and its calls itself;
- `ban_program(addresses)` and `filter_listener(fd, inode, program)`: a classic BPF program on a listening socket
  that drops the packets of banned addresses (their SYNs: no new connection from them reaches gRPC).
Linux only (/proc, TCP_INFO, SO_ATTACH_FILTER).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct

# struct tcp_info (linux/tcp.h): tcpi_state is byte 0; tcpi_bytes_acked and tcpi_bytes_received are the u64s at
# byte 120 (Linux >= 4.1).
_TCP_INFO_LEN = 136
_ESTABLISHED = 1

# Classic BPF (linux/filter.h), run by the kernel on each segment before it reaches the socket; the packet starts at
# the TCP header. Accept a segment without payload (ACK, FIN, RST), drop one that carries data.
_DROP_DATA = [
    (0x80, 0, 0, 0),  # A = segment length                    BPF_LD | BPF_W | BPF_LEN
    (0x07, 0, 0, 0),  # X = A                                 BPF_MISC | BPF_TAX
    (0x30, 0, 0, 12),  # A = TCP header byte 12 (data offset) BPF_LD | BPF_B | BPF_ABS
    (0x74, 0, 0, 4),  # A >>= 4                               BPF_ALU | BPF_RSH | BPF_K
    (0x64, 0, 0, 2),  # A <<= 2: the header's length          BPF_ALU | BPF_LSH | BPF_K
    (0x1D, 1, 0, 0),  # header only: accept                   BPF_JMP | BPF_JEQ | BPF_X
    (0x06, 0, 0, 0),  # drop                                  BPF_RET | BPF_K
    (0x06, 0, 0, 0xFFFFFFFF),  # accept
]
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27
_NET = 0xFFF00000  # SKF_NET_OFF: offsets from the IP header (the packet starts at the TCP header)
_MAX_FILTERED = 40  # banned addresses the listeners' filter can name (a jump spans at most 255 instructions)
_FILTER = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in _DROP_DATA))
_PROGRAM = struct.pack("HxxxxxxP", len(_DROP_DATA), ctypes.addressof(_FILTER))  # struct sock_fprog


def ban_program(addresses: list[str]) -> tuple[bytes, ctypes.Array] | None:
    """A classic BPF program (struct sock_fprog, and the buffer it points to) that drops IPv4 and IPv6 packets
    from `addresses` (at most _MAX_FILTERED; IPv4 ones also as IPv4-mapped IPv6) and accepts all others; None for
    none."""
    v4 = [socket.inet_aton(a) for a in addresses if ":" not in a][:_MAX_FILTERED]
    v6 = [socket.inet_pton(socket.AF_INET6, a) for a in addresses if ":" in a][:_MAX_FILTERED // 4]
    if not v4 and not v6:
        return None
    drop, accept = "drop", "accept"
    ops: list[tuple[int, int | str, int | str, int]] = [
        (0x30, 0, 0, _NET),  # A = the IP header's first byte       BPF_LD | BPF_B | BPF_ABS
        (0x74, 0, 0, 4),  # A >>= 4: the IP version
        (0x15, 0, "v6", 4),  # IPv4?                                  BPF_JMP | BPF_JEQ | BPF_K
        (0x20, 0, 0, _NET + 12),  # A = IPv4 source                 BPF_LD | BPF_W | BPF_ABS
        *[(0x15, drop, 0, struct.unpack(">I", a)[0]) for a in v4],
        (0x05, 0, 0, accept),  # BPF_JMP | BPF_JA
    ]
    ops.append(("v6",))  # label
    ops.append((0x15, 0, accept, 6))
    for a in v6:
        words = struct.unpack(">4I", a)
        for i, w in enumerate(words):  # source: bytes 8-23 of the IPv6 header
            ops.append((0x20, 0, 0, _NET + 8 + 4 * i))
            ops.append((0x15, 0 if i < 3 else drop, "next", w))
        ops.append(("next",))
    ops += [("accept",), (0x06, 0, 0, 0xFFFFFFFF), ("drop",), (0x06, 0, 0, 0)]
    # resolve labels into relative jumps ("next": the label after this address' words)
    code: list[tuple[int, int | str, int | str, int | str]] = []
    labels: dict[str, int] = {}
    nexts: list[int] = []
    for op in ops:
        if len(op) == 1:
            if op[0] == "next":
                nexts.append(len(code))
            else:
                labels[op[0]] = len(code)
        else:
            code.append(op)
    out = []
    next_index = 0
    for i, (kind, jt, jf, k) in enumerate(code):
        while next_index < len(nexts) and nexts[next_index] <= i:
            next_index += 1
        here = {**labels, "next": nexts[next_index] if next_index < len(nexts) else 0}
        jt, jf, k = (here[x] - i - 1 if isinstance(x, str) else x for x in (jt, jf, k))  # BPF_JA: the offset is k
        out.append(struct.pack("HBBI", kind, jt, jf, k))
    buffer = ctypes.create_string_buffer(b"".join(out))
    return struct.pack("HxxxxxxP", len(out), ctypes.addressof(buffer)), buffer


def dup_socket(fd: int, inode: int | None) -> socket.socket | None:
    """A socket object on a duplicate of `fd` (closing it leaves `fd` open); None when `fd` is no longer the
    socket `inode` (gRPC closed it, and the number may be another file's now). With `inode` (a TCP socket seen
    before) the object is made as an AF_INET one whatever its family, which socket options and shutdown do not
    look at: asking the kernel the family, type and protocol is three system calls per connection and tick."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if inode is not None and os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        if inode is not None:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=dup)
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


LISTENING = ("", 0)  # what `peer_on` says of a listening socket


def peer_on(fd: int, ports: set[int]) -> tuple[str, int] | None:
    """(address, port) of the peer when `fd` is a connected TCP socket whose local port is in `ports`; LISTENING
    when it is the listening socket of one of them."""
    sock = dup_socket(fd, None)
    if sock is None:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        if sock.getsockname()[1] not in ports:
            return None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return LISTENING
        host, port = sock.getpeername()[:2]
        return host.removeprefix("::ffff:"), port
    except OSError:
        return None  # already gone
    finally:
        sock.close()


def counters(fd: int, inode: int) -> tuple[int, int] | None:
    """(bytes the peer acknowledged, bytes received) of the established connection `fd` (socket `inode`); None when
    it is gone or no longer established."""
    sock = dup_socket(fd, inode)
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    finally:
        sock.close()
    if info[0] != _ESTABLISHED:
        return None
    acked, received = struct.unpack_from("=QQ", info, 120)
    return acked, received


def filter_listener(fd: int, inode: int, program: tuple[bytes, ctypes.Array] | None) -> bool:
    """Attach `program` (`ban_program`'s) to the listening socket `fd`, or detach its filter for None; False when
    `fd` is no longer that socket. A filter the kernel refuses is left out: the guard's ticks still cut."""
    sock = dup_socket(fd, inode)
    if sock is None:
        return False
    try:
        if program is None:
            sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        else:
            sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program[0])
    except OSError:
        pass  # no filter attached (detaching none), or filters refused
    finally:
        sock.close()
    return True


def cut_socket(fd: int, inode: int) -> bool:
    """Stop a connection that gRPC owns: drop the data it still sends, shut it down both ways, discard what is
    queued (the module docstring). False when `fd` is no longer that socket."""
    sock = dup_socket(fd, inode)
    if sock is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _PROGRAM)
        sock.shutdown(socket.SHUT_RDWR)
        discard_queued(sock)
        return True
    except OSError:
        return False
    finally:
        sock.close()


_SCRATCH = bytearray(64 << 10)  # recv's buffer (Python wants one as long as each read), never written to: MSG_TRUNC
# discards without copying. Zero-filled when made, so it is resident: small, and a backlog of megabytes is 16 reads a
# megabyte, at a cut only


def discard_queued(sock: socket.socket) -> int:
    """Drop the bytes queued in `sock`'s receive buffer without reading them (TCP's MSG_TRUNC: the kernel frees
    them and copies nothing); returns how many. After a shutdown the queue no longer grows and a read past it
    returns 0."""
    dropped = 0
    while True:
        try:
            n = sock.recv_into(_SCRATCH, len(_SCRATCH), socket.MSG_TRUNC | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return dropped
        if n <= 0:
            return dropped
        dropped += n
