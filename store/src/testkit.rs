//! For tests (feature `testkit`): what another user (a jailed VMM's) can
//! open of a store; the environment for a test's own cargo builds.

use std::ffi::CString;
use std::os::fd::FromRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// What `open(2)` (read-only) of each of `paths` gives user `uid`, group
/// `gid`, with no other groups, in root `root` (`chroot`; `None`: this
/// process's): 0 where it opened, else the error number. Runs in a forked
/// child, so needs root.
///
/// # Panics
/// If a path holds a NUL byte, or the child cannot become the user.
pub fn opens_as(root: Option<&Path>, uid: u32, gid: u32, paths: &[PathBuf]) -> Vec<i32> {
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).expect("a path without NUL");
    let root = root.map(c);
    let paths: Vec<CString> = paths.iter().map(|p| c(p)).collect();
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into a two-element array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the child makes only system calls (no allocation, no locks)
    // on memory prepared before the fork, then exits.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        // SAFETY: system calls on valid, NUL-terminated strings and buffers.
        unsafe {
            if let Some(root) = &root {
                if libc::chroot(root.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
                    libc::_exit(1);
                }
            }
            if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0
                || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
            {
                libc::_exit(1);
            }
            for p in &paths {
                let fd = libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                let errno = if fd < 0 {
                    *libc::__errno_location()
                } else {
                    libc::close(fd);
                    0
                };
                if libc::write(fds[1], (&raw const errno).cast(), 4) != 4 {
                    libc::_exit(2);
                }
            }
            libc::_exit(0);
        }
    }
    // SAFETY: our copy of the write end, closed once.
    unsafe { libc::close(fds[1]) };
    // SAFETY: the read end is ours alone from here.
    let mut r = std::fs::File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[0]) });
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut r, &mut out).expect("reading the child's answers");
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child as user {uid} failed: {status:#x}"
    );
    out.chunks_exact(4)
        .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Clears from `cmd` the variables `cargo test` sets for a test process
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...), for a test that runs cargo,
/// or a script that does, to build workspace binaries: a build script that
/// tracks one of them (ring's tracks `CARGO_MANIFEST_DIR`) sees it change
/// from one test package to the next and runs again, and every crate above
/// it is built again (minutes, for the workspace's binaries). `CARGO`, the
/// cargo running the tests, stays.
pub fn clear_cargo_test_env(cmd: &mut std::process::Command) -> &mut std::process::Command {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
            || matches!(
                &*name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            )
        {
            cmd.env_remove(&*name);
        }
    }
    cmd
}
