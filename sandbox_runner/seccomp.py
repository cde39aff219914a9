"""A small seccomp filter for the bubblewrap backend (bwrap --seccomp FD).

Compiled with the host's libseccomp (Debian's libseccomp2, through ctypes; no
Python binding needed): every system call allowed except those a sandboxed
program has no business making, which fail with EPERM. Other architectures'
system calls (i386, x32) kill the process (libseccomp's default for a foreign
architecture), so the 32-bit entry points are no way around the list.

This is narrower than Docker's default profile (an allowlist of ~300 calls):
it closes the kernel attack surface that matters most inside a namespace
sandbox (mounts, namespaces, tracing, keyrings, BPF, io_uring, modules, perf).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000  # | errno

BLOCKED = (
    # mounts and namespaces
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel keyrings
    "keyctl", "add_key", "request_key",
    # BPF, perf, userfaultfd, io_uring (a kernel surface of its own, with a long list
    # of privilege escalations; Docker's default profile dropped it too)
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # modules, kexec, reboot, swap, accounting, quotas, raw I/O ports
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "iopl", "ioperm",
    # file handles (escape a bind mount), kernel log, obsolete calls
    "open_by_handle_at", "name_to_handle_at", "syslog", "lookup_dcookie", "uselib",
)  # fmt: skip


@functools.cache
def filter_program() -> bytes | None:
    """The compiled BPF program, or None where libseccomp is missing or fails."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return None
    read_end, write_end = os.pipe()
    try:
        for name in BLOCKED:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a call on this architecture
            if lib.seccomp_rule_add(ctx, SCMP_ACT_ERRNO | errno.EPERM, number, 0) != 0:
                return None
        if lib.seccomp_export_bpf(ctx, write_end) != 0:
            return None
        os.close(write_end)
        write_end = -1
        program = b""
        while chunk := os.read(read_end, 65536):
            program += chunk
        return program or None
    finally:
        lib.seccomp_release(ctx)
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def program_fd() -> int | None:
    """A readable fd holding the program (for bwrap --seccomp), or None."""
    program = filter_program()
    if program is None:
        return None
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # a few hundred bytes: far below a pipe's buffer
    finally:
        os.close(write_end)
    return read_end
