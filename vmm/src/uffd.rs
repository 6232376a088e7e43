//! Lazy restore through userfaultfd: a VM restored from a snapshot whose
//! memory is not on this node starts once its state is there and faults
//! the rest in on demand, served by a page server (Firecracker's UFFD
//! handler protocol, reduced to what Twig needs).
//!
//! **Who does what.** The caller (a root process) opens `/dev/userfaultfd`
//! and sends it with the restore request, with one end of a connected Unix
//! stream socket whose other end is the page server. The (possibly jailed,
//! unprivileged) VMM makes its own userfaultfd from it with
//! `USERFAULTFD_IOC_NEW` (a full one, whose faults include the kernel's:
//! KVM's faults on guest RAM are; no `vm.unprivileged_userfaultfd`
//! needed), registers all of guest RAM (anonymous, private) for missing
//! pages, and sends the page server the handshake: one JSON line,
//! [`Layout`], with the userfaultfd attached (`SCM_RIGHTS`). Only then does
//! it load vCPU and device state (which may read guest memory: those
//! faults are served too) and run.
//!
//! **The page server** ([`PageServer`]) reads faults from the userfaultfd
//! and answers each with `UFFDIO_COPY` (or `UFFDIO_ZEROPAGE`), the
//! contents every page would have after a normal restore of the snapshot
//! (its whole chain composed); it may push pages nobody asked for yet.
//! When every page is there it writes `complete\n`: the VMM unregisters
//! RAM (later missing pages, say after a balloon discard, are zero-filled
//! as usual) and stops listening.
//!
//! **A page source that vanishes** (the socket reaches end-of-file, fails,
//! or says anything but `complete`) leaves a vCPU waiting for a page
//! forever: the VMM logs "the page server of the lazy restore went away
//! before guest memory was complete" and exits with status 1, so the pod is
//! reported failed rather than left hanging.
//!
//! Both sides read each other's messages as hostile input: lines are
//! bounded, numbers checked (alignment, overflow, counts).

use std::fs::File;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// `UFFD_API`.
const UFFD_API: u64 = 0xAA;
/// `UFFDIO_REGISTER_MODE_MISSING`.
const REGISTER_MODE_MISSING: u64 = 1;
/// `UFFD_EVENT_PAGEFAULT`.
const EVENT_PAGEFAULT: u8 = 0x12;
/// Bits of `uffdio_register.ioctls`: `_UFFDIO_COPY`, `_UFFDIO_ZEROPAGE`.
const CAN_COPY: u64 = 1 << 3;
const CAN_ZEROPAGE: u64 = 1 << 4;
/// Bit of `uffdio_api.ioctls`: `_UFFDIO_REGISTER`.
const CAN_REGISTER: u64 = 1 << 0;

/// The request numbers (linux/userfaultfd.h); `jail/seccomp/rules.rs`
/// allows the VMM's and a test checks both agree.
mod nr {
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iowr_nr};
    ioctl_io_nr!(USERFAULTFD_IOC_NEW, 0xAA, 0x00);
    ioctl_iowr_nr!(UFFDIO_API, 0xAA, 0x3F, super::UffdioApi);
    ioctl_iowr_nr!(UFFDIO_REGISTER, 0xAA, 0x00, super::UffdioRegister);
    ioctl_ior_nr!(UFFDIO_UNREGISTER, 0xAA, 0x01, super::UffdioRange);
    ioctl_iowr_nr!(UFFDIO_COPY, 0xAA, 0x03, super::UffdioCopy);
    ioctl_iowr_nr!(UFFDIO_ZEROPAGE, 0xAA, 0x04, super::UffdioZeropage);
}

/// `struct uffdio_api`.
#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_copy`.
#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// `struct uffdio_zeropage`.
#[repr(C)]
#[derive(Default)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

/// `struct uffd_msg` (32 bytes); for `UFFD_EVENT_PAGEFAULT`, `arg[0]` is
/// the flags and `arg[1]` the faulting address.
#[repr(C)]
#[derive(Default)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    arg: [u64; 3],
}

const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);
const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);

/// An ioctl on `fd` with a pointer to `arg`; the OS error on failure.
fn ioctl<T>(fd: &impl AsRawFd, req: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
    // SAFETY: every request used here takes a pointer to the #[repr(C)]
    // struct `T` lays out (checked by the request number's encoded size),
    // which lives for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The VMM's userfaultfd.
pub(crate) struct Uffd {
    fd: OwnedFd,
}

impl Uffd {
    /// Makes a userfaultfd for this process from `dev`, an open
    /// `/dev/userfaultfd`, and agrees on the API. Nothing else changes: a
    /// descriptor that is not `/dev/userfaultfd` is refused here.
    pub(crate) fn open(dev: &File) -> Result<Uffd> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value and returns
        // a new descriptor, owned below.
        let fd = unsafe { libc::ioctl(dev.as_raw_fd(), nr::USERFAULTFD_IOC_NEW() as _, flags) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::Config(format!(
                "lazy restore: the descriptor sent as /dev/userfaultfd does not make a userfaultfd (USERFAULTFD_IOC_NEW: {e})"
            )));
        }
        // SAFETY: the kernel just returned this new descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut api = UffdioApi {
            api: UFFD_API,
            ..Default::default()
        };
        ioctl(&fd, nr::UFFDIO_API(), &mut api).map_err(|e| Error::io("UFFDIO_API", e))?;
        if api.ioctls & CAN_REGISTER == 0 {
            return Err(Error::Config(
                "lazy restore: this kernel's userfaultfd cannot register memory".into(),
            ));
        }
        Ok(Uffd { fd })
    }

    /// Registers `len` bytes at `addr` for missing-page faults.
    pub(crate) fn register(&self, addr: u64, len: u64) -> Result<()> {
        let mut reg = UffdioRegister {
            range: UffdioRange { start: addr, len },
            mode: REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        ioctl(&self.fd, nr::UFFDIO_REGISTER(), &mut reg)
            .map_err(|e| Error::io("registering guest RAM with the userfaultfd", e))?;
        if reg.ioctls & (CAN_COPY | CAN_ZEROPAGE) != CAN_COPY | CAN_ZEROPAGE {
            return Err(Error::Config(
                "lazy restore: guest RAM cannot be filled through the userfaultfd".into(),
            ));
        }
        Ok(())
    }

    /// Unregisters `len` bytes at `addr`: missing pages are zero-filled
    /// again.
    pub(crate) fn unregister(&self, addr: u64, len: u64) -> Result<()> {
        let mut range = UffdioRange { start: addr, len };
        ioctl(&self.fd, nr::UFFDIO_UNREGISTER(), &mut range)
            .map_err(|e| Error::io("unregistering guest RAM from the userfaultfd", e))
    }
}

/// The only page size served.
pub const PAGE_SIZE: u64 = 4096;
/// The longest handshake line accepted, in bytes.
pub const MAX_HANDSHAKE: usize = 4096;
/// The most memory regions a handshake may describe.
pub const MAX_REGIONS: usize = 16;
/// The most guest memory a handshake may describe (1 TiB).
pub const MAX_MEM: u64 = 1 << 40;
/// The message that ends a lazy restore.
const COMPLETE: &[u8] = b"complete\n";

/// A range of guest memory in the VMM's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Where it starts in the VMM's address space.
    pub host_addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The guest physical address it starts at.
    pub guest_addr: u64,
}

/// Guest memory as the VMM lays it out: the handshake's JSON line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Bytes per page ([`PAGE_SIZE`]).
    pub page_size: u64,
    /// Guest RAM in bytes: the page server serves pages `0..mem_size /
    /// page_size` of the snapshot's memory.
    pub mem_size: u64,
    /// The regions, each inside `0..mem_size` in guest addresses.
    pub regions: Vec<Region>,
}

impl Layout {
    /// Parses and checks a handshake line (without its newline): one page
    /// size, at most [`MAX_REGIONS`] page-aligned, non-empty, non-
    /// overlapping regions inside `mem_size` (at most [`MAX_MEM`]).
    pub fn parse(line: &[u8]) -> Result<Layout> {
        let bad = |why: String| Error::Config(format!("lazy restore handshake: {why}"));
        if line.len() > MAX_HANDSHAKE {
            return Err(bad(format!("longer than {MAX_HANDSHAKE} bytes")));
        }
        let layout: Layout =
            serde_json::from_slice(line).map_err(|e| bad(format!("not a layout: {e}")))?;
        layout.validate().map_err(bad)?;
        Ok(layout)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.page_size != PAGE_SIZE {
            return Err(format!(
                "page size {} (only {PAGE_SIZE} is served)",
                self.page_size
            ));
        }
        if self.mem_size == 0 || self.mem_size % PAGE_SIZE != 0 || self.mem_size > MAX_MEM {
            return Err(format!(
                "guest memory of {} bytes (whole pages, at most {MAX_MEM})",
                self.mem_size
            ));
        }
        if self.regions.is_empty() || self.regions.len() > MAX_REGIONS {
            return Err(format!(
                "{} regions (1 to {MAX_REGIONS})",
                self.regions.len()
            ));
        }
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for r in &self.regions {
            let aligned = r.host_addr % PAGE_SIZE == 0 && r.guest_addr % PAGE_SIZE == 0;
            if r.size == 0 || r.size % PAGE_SIZE != 0 || !aligned {
                return Err(format!("region {r:?} is not whole, aligned pages"));
            }
            let inside = r
                .guest_addr
                .checked_add(r.size)
                .is_some_and(|end| end <= self.mem_size)
                && r.host_addr.checked_add(r.size).is_some();
            if !inside {
                return Err(format!("region {r:?} is outside guest memory"));
            }
            spans.push((r.guest_addr, r.guest_addr + r.size));
        }
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err("regions overlap".into());
        }
        Ok(())
    }

    /// The region and host address of guest page `page`, if inside one.
    fn host_of(&self, page: u64) -> Option<(&Region, u64)> {
        let gpa = page.checked_mul(self.page_size)?;
        self.regions
            .iter()
            .find(|r| gpa >= r.guest_addr && gpa - r.guest_addr < r.size)
            .map(|r| (r, r.host_addr + (gpa - r.guest_addr)))
    }

    /// The guest page at host address `addr`, if inside a region.
    fn page_of(&self, addr: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| addr >= r.host_addr && addr - r.host_addr < r.size)
            .map(|r| (r.guest_addr + (addr - r.host_addr)) / self.page_size)
    }

    /// Pages in guest memory.
    pub fn pages(&self) -> u64 {
        self.mem_size / self.page_size
    }
}

/// Checks that `sock` is a stream socket.
pub(crate) fn check_stream(sock: &UnixStream) -> Result<()> {
    use nix::sys::socket::{getsockopt, sockopt, SockType};
    let bad = |why: String| {
        Error::Config(format!(
            "lazy restore: the page server's descriptor is not a connected stream socket ({why})"
        ))
    };
    match getsockopt(sock, sockopt::SockType) {
        Ok(SockType::Stream) => {}
        Ok(t) => return Err(bad(format!("{t:?}"))),
        Err(e) => return Err(bad(e.to_string())),
    }
    // Not connected: the handshake's sendmsg fails (the API filter has no
    // getpeername to check it sooner).
    Ok(())
}

/// Sends the page server the handshake: `layout` as one JSON line, with
/// the userfaultfd attached.
pub(crate) fn send_handshake(sock: &UnixStream, layout: &Layout, uffd: &Uffd) -> Result<()> {
    let mut line = serde_json::to_vec(layout)
        .map_err(|e| Error::Config(format!("encoding the lazy restore handshake: {e}")))?;
    line.push(b'\n');
    let fds = [uffd.fd.as_raw_fd()];
    let mut sent = 0;
    while sent < line.len() {
        let iov = [IoSlice::new(&line[sent..])];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 { &cmsg } else { &[] };
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                return Err(Error::io(
                    "sending the page server the lazy restore handshake",
                    e.into(),
                ))
            }
        }
    }
    Ok(())
}

/// Watches the page server's socket of a lazy restore (see the module
/// docs); dropping it stops the watch without touching the VM (a restore
/// that failed, a VM dropped).
pub(crate) struct Watcher {
    cancel: Arc<OwnedFd>,
    complete: Arc<AtomicBool>,
}

impl Watcher {
    /// Starts watching `sock` on a thread of its own (it inherits the
    /// calling thread's seccomp filter): `complete` unregisters `len` bytes
    /// at `addr` from `uffd`; anything else ends the process.
    pub(crate) fn spawn(uffd: Uffd, sock: UnixStream, addr: u64, len: u64) -> Result<Watcher> {
        // SAFETY: eventfd with constant flags; the descriptor is owned below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(Error::io(
                "eventfd for the lazy restore watcher",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: the kernel just returned this new descriptor.
        let cancel = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let complete = Arc::new(AtomicBool::new(false));
        let (c, done) = (cancel.clone(), complete.clone());
        std::thread::Builder::new()
            .name("twig-lazy".into())
            .spawn(move || watch(&uffd, sock, &c, &done, addr, len))
            .map_err(|e| Error::io("starting the lazy restore watcher", e))?;
        Ok(Watcher { cancel, complete })
    }

    /// Whether the page server said every page is there.
    pub(crate) fn is_complete(&self) -> bool {
        self.complete.load(Ordering::SeqCst)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local buffer to our eventfd.
        unsafe { libc::write(self.cancel.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// Polls `fds` for input; the indices that are ready (or hung up).
fn poll_in(fds: &[RawFd], timeout: Option<Duration>) -> std::io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    // SAFETY: `pfds` is a live array of `pfds.len()` pollfds.
    let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(e);
    }
    Ok(pfds.iter().map(|p| p.revents != 0).collect())
}

fn watch(
    uffd: &Uffd,
    mut sock: UnixStream,
    cancel: &OwnedFd,
    complete: &AtomicBool,
    addr: u64,
    len: u64,
) {
    let mut got = Vec::with_capacity(COMPLETE.len());
    let why = loop {
        let ready = match poll_in(&[sock.as_raw_fd(), cancel.as_raw_fd()], None) {
            Ok(r) => r,
            Err(e) => break format!("polling its socket failed: {e}"),
        };
        if ready[1] {
            tracing::debug!("lazy restore watch cancelled");
            return;
        }
        if !ready[0] {
            continue;
        }
        let mut buf = [0u8; 16];
        let room = COMPLETE.len() - got.len();
        match sock.read(&mut buf[..room]) {
            Ok(0) => break "its socket reached end-of-file".to_string(),
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if !COMPLETE.starts_with(&got) {
                    break format!(
                        "it sent {:?} instead of \"complete\"",
                        String::from_utf8_lossy(&got)
                    );
                }
                if got == COMPLETE {
                    if let Err(e) = uffd.unregister(addr, len) {
                        break format!("after it completed, {e}");
                    }
                    complete.store(true, Ordering::SeqCst);
                    tracing::info!("lazy restore complete: guest memory is all there");
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => break format!("reading its socket failed: {e}"),
        }
    };
    let msg = format!(
        "the page server of the lazy restore went away before guest memory was complete ({why}); a vCPU may wait for a page forever: exiting"
    );
    tracing::error!("{msg}");
    eprintln!("twig-vmm: {msg}");
    std::process::exit(1);
}

/// The page server's end of one lazy restore (the node's side): faults to
/// answer, pages to copy in.
pub struct PageServer {
    conn: UnixStream,
    uffd: OwnedFd,
    layout: Layout,
}

impl PageServer {
    /// Takes the VMM's handshake from `conn` (the socket whose other end
    /// went with the restore request), waiting at most `timeout`: the
    /// layout, checked as hostile input, and the userfaultfd.
    pub fn accept(conn: UnixStream, timeout: Duration) -> Result<PageServer> {
        let deadline = Instant::now() + timeout;
        let bad = |why: &str| Error::Config(format!("lazy restore handshake: {why}"));
        let mut line: Vec<u8> = Vec::new();
        let mut uffd: Option<OwnedFd> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(bad(&format!("none within {timeout:?}")));
            }
            let ready = poll_in(&[conn.as_raw_fd()], Some(left))
                .map_err(|e| Error::io("waiting for the lazy restore handshake", e))?;
            if !ready[0] {
                continue;
            }
            let mut buf = [0u8; 1024];
            let mut iov = [IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!([RawFd; 4]);
            let msg = match recvmsg::<()>(
                conn.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(m) => m,
                Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(Error::io("reading the lazy restore handshake", e.into())),
            };
            let n = msg.bytes;
            let cmsgs = msg
                .cmsgs()
                .map_err(|e| Error::io("reading the handshake's descriptors", e.into()))?;
            for cmsg in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = cmsg {
                    for fd in fds {
                        // SAFETY: the kernel just installed `fd` for us.
                        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                        if uffd.is_none() {
                            uffd = Some(fd);
                        } else {
                            return Err(bad("more than one descriptor"));
                        }
                    }
                }
            }
            if n == 0 {
                return Err(bad("the VMM closed the connection before it"));
            }
            line.extend_from_slice(&buf[..n]);
            if let Some(end) = line.iter().position(|b| *b == b'\n') {
                if end + 1 != line.len() {
                    return Err(bad("bytes after the handshake line"));
                }
                line.truncate(end);
                break;
            }
            if line.len() > MAX_HANDSHAKE {
                return Err(bad(&format!("longer than {MAX_HANDSHAKE} bytes")));
            }
        }
        let layout = Layout::parse(&line)?;
        let uffd = uffd.ok_or_else(|| bad("no userfaultfd came with it"))?;
        Ok(PageServer { conn, uffd, layout })
    }

    /// Guest memory as the VMM laid it out.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The next guest page a thread of the VMM waits for, waiting at most
    /// `timeout` (`None`: until one comes); `Ok(None)` when none came. An
    /// error when the VMM is gone (its end of the socket closed) or wrote
    /// anything.
    pub fn next_fault(&self, timeout: Option<Duration>) -> Result<Option<u64>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let ready = poll_in(&[self.uffd.as_raw_fd(), self.conn.as_raw_fd()], left)
                .map_err(|e| Error::io("waiting for a page fault", e))?;
            if ready[1] {
                let mut b = [0u8; 1];
                return Err(match (&self.conn).read(&mut b) {
                    Ok(0) => Error::Config("lazy restore: the VMM is gone".into()),
                    Ok(_) => Error::Config("lazy restore: the VMM wrote to the page server".into()),
                    Err(e) => Error::io("lazy restore: the VMM's socket", e),
                });
            }
            if ready[0] {
                let mut msg = UffdMsg::default();
                // SAFETY: reads at most one uffd_msg into a local of that
                // layout.
                let n = unsafe {
                    libc::read(
                        self.uffd.as_raw_fd(),
                        (&mut msg as *mut UffdMsg).cast(),
                        std::mem::size_of::<UffdMsg>(),
                    )
                };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) {
                        return Err(Error::io("reading the userfaultfd", e));
                    }
                } else if n as usize == std::mem::size_of::<UffdMsg>()
                    && msg.event == EVENT_PAGEFAULT
                {
                    match self.layout.page_of(msg.arg[1]) {
                        Some(p) => return Ok(Some(p)),
                        None => tracing::warn!(
                            addr = msg.arg[1],
                            "a page fault outside the layout, ignored"
                        ),
                    }
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
        }
    }

    /// The host address of `pages` pages from guest page `first`, all in
    /// one region.
    fn host_range(&self, first: u64, pages: u64) -> Result<u64> {
        let out = || {
            Error::Config(format!(
                "pages {first}..+{pages} are not inside one region of guest memory"
            ))
        };
        let (r, host) = self.layout.host_of(first).ok_or_else(out)?;
        let len = pages.checked_mul(PAGE_SIZE).ok_or_else(out)?;
        if host - r.host_addr + len > r.size {
            return Err(out());
        }
        Ok(host)
    }

    /// Copies `data` (whole pages) into guest memory from guest page
    /// `first` and wakes whoever waits for them (`UFFDIO_COPY`); pages
    /// already there are left as they are. Returns the pages it filled.
    pub fn copy(&self, first: u64, data: &[u8]) -> Result<u64> {
        if data.is_empty() || data.len() as u64 % PAGE_SIZE != 0 {
            return Err(Error::Config(format!(
                "{} bytes are not whole pages",
                data.len()
            )));
        }
        let pages = data.len() as u64 / PAGE_SIZE;
        let host = self.host_range(first, pages)?;
        let src = data.as_ptr() as u64;
        self.fill(host, data.len() as u64, |dst, off, len| {
            let mut c = UffdioCopy {
                dst,
                src: src + off,
                len,
                ..Default::default()
            };
            let r = ioctl(&self.uffd, nr::UFFDIO_COPY(), &mut c);
            (r, c.copy)
        })
    }

    /// Fills `pages` pages from guest page `first` with zeroes
    /// (`UFFDIO_ZEROPAGE`), leaving pages already there; returns the pages
    /// it filled.
    pub fn zero(&self, first: u64, pages: u64) -> Result<u64> {
        if pages == 0 {
            return Ok(0);
        }
        let host = self.host_range(first, pages)?;
        self.fill(host, pages * PAGE_SIZE, |dst, _, len| {
            let mut z = UffdioZeropage {
                range: UffdioRange { start: dst, len },
                ..Default::default()
            };
            let r = ioctl(&self.uffd, nr::UFFDIO_ZEROPAGE(), &mut z);
            (r, z.zeropage)
        })
    }

    /// Runs `op(dst, offset, len)` over `len` bytes at `host`: a partial
    /// fill goes on after what was done; a page already present (`EEXIST`)
    /// is stepped over.
    fn fill(
        &self,
        host: u64,
        len: u64,
        op: impl Fn(u64, u64, u64) -> (std::io::Result<()>, i64),
    ) -> Result<u64> {
        let (mut off, mut filled) = (0u64, 0u64);
        while off < len {
            let n = len - off;
            let (r, done) = op(host + off, off, n);
            // On failure the kernel reports the bytes done before it, or a
            // negative error when none were.
            let done = u64::try_from(done).unwrap_or(0).min(n) / PAGE_SIZE * PAGE_SIZE;
            match r {
                Ok(()) => {
                    filled += n / PAGE_SIZE;
                    off += n;
                }
                Err(e) => match e.raw_os_error() {
                    // Partly done (stopped at a page already there, or
                    // interrupted): go on after what was.
                    Some(libc::EAGAIN) | Some(libc::EINTR) => {
                        filled += done / PAGE_SIZE;
                        off += done;
                    }
                    // The first page is there already: step over it.
                    Some(libc::EEXIST) => off += done + PAGE_SIZE,
                    Some(libc::ESRCH) | Some(libc::ENOENT) => {
                        return Err(Error::Config(
                            "lazy restore: the VMM or its guest memory is gone".into(),
                        ))
                    }
                    _ => return Err(Error::io("filling guest memory (userfaultfd)", e)),
                },
            }
        }
        Ok(filled)
    }

    /// Tells the VMM every page is there (`complete`): it stops taking
    /// faults and lets missing pages be zero-filled from now on.
    pub fn complete(self) -> Result<()> {
        (&self.conn)
            .write_all(COMPLETE)
            .map_err(|e| Error::io("telling the VMM the lazy restore is complete", e))
    }

    /// The socket, for callers that watch it with others.
    pub fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        self.conn.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_numbers_match_the_header_and_the_seccomp_rules() {
        assert_eq!(nr::USERFAULTFD_IOC_NEW(), 0xaa00);
        assert_eq!(nr::UFFDIO_API(), 0xc018_aa3f);
        assert_eq!(nr::UFFDIO_REGISTER(), 0xc020_aa00);
        assert_eq!(nr::UFFDIO_UNREGISTER(), 0x8010_aa01);
        assert_eq!(nr::UFFDIO_COPY(), 0xc028_aa03);
        assert_eq!(nr::UFFDIO_ZEROPAGE(), 0xc020_aa04);
        use crate::jail::seccomp::rules::nr as rules;
        assert_eq!(rules::USERFAULTFD_IOC_NEW(), nr::USERFAULTFD_IOC_NEW());
        assert_eq!(rules::UFFDIO_API(), nr::UFFDIO_API());
        assert_eq!(rules::UFFDIO_REGISTER(), nr::UFFDIO_REGISTER());
        assert_eq!(rules::UFFDIO_UNREGISTER(), nr::UFFDIO_UNREGISTER());
        assert_eq!(rules::UFFDIO_COPY(), nr::UFFDIO_COPY());
        assert_eq!(rules::UFFDIO_ZEROPAGE(), nr::UFFDIO_ZEROPAGE());
    }

    fn line(page: u64, mem: u64, regions: &[(u64, u64, u64)]) -> Vec<u8> {
        serde_json::to_vec(&Layout {
            page_size: page,
            mem_size: mem,
            regions: regions
                .iter()
                .map(|&(host_addr, size, guest_addr)| Region {
                    host_addr,
                    size,
                    guest_addr,
                })
                .collect(),
        })
        .unwrap()
    }

    #[test]
    fn handshakes_are_checked_as_hostile_input() {
        let mib = 1 << 20;
        let ok = Layout::parse(&line(4096, 64 * mib, &[(0x7f00_0000_0000, 64 * mib, 0)])).unwrap();
        assert_eq!(ok.pages(), 16384);
        assert_eq!(ok.page_of(0x7f00_0000_0000 + 8191), Some(1));
        assert_eq!(ok.page_of(0x7f00_0000_0000 + 64 * mib), None);
        assert_eq!(ok.host_of(2).map(|(_, h)| h), Some(0x7f00_0000_2000));
        assert!(ok.host_of(16384).is_none());
        assert!(ok.host_of(u64::MAX).is_none());
        let bad: &[(&str, Vec<u8>)] = &[
            ("page size", line(2 << 20, 64 * mib, &[(0, 64 * mib, 0)])),
            ("zero memory", line(4096, 0, &[(0, 4096, 0)])),
            ("unaligned memory", line(4096, 4097, &[(0, 4096, 0)])),
            ("too much memory", line(4096, MAX_MEM * 2, &[(0, 4096, 0)])),
            ("no regions", line(4096, 4096, &[])),
            ("zero region", line(4096, 4096, &[(0, 0, 0)])),
            ("misaligned host", line(4096, 8192, &[(0x1001, 4096, 0)])),
            ("misaligned guest", line(4096, 8192, &[(0, 4096, 0x800)])),
            ("outside", line(4096, 8192, &[(0, 8192, 4096)])),
            ("overflow", line(4096, 8192, &[(u64::MAX - 4095, 4096, 0)])),
            (
                "overlap",
                line(4096, 16384, &[(0, 8192, 0), (0x10000, 8192, 4096)]),
            ),
            (
                "too many regions",
                line(4096, 1 << 30, &[(0, 4096, 0); MAX_REGIONS + 1]),
            ),
            ("not json", b"complete".to_vec()),
            (
                "unknown field",
                br#"{"page_size":4096,"mem_size":4096,"regions":[],"x":1}"#.to_vec(),
            ),
            (
                "negative",
                br#"{"page_size":4096,"mem_size":-4096,"regions":[]}"#.to_vec(),
            ),
            ("oversize", vec![b' '; MAX_HANDSHAKE + 1]),
        ];
        for (what, l) in bad {
            let e = Layout::parse(l).expect_err(what);
            assert!(e.to_string().contains("handshake"), "{what}: {e}");
        }
    }

    #[test]
    fn accept_refuses_handshakes_without_a_userfaultfd_or_too_long() {
        let t = Duration::from_secs(5);
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&line(4096, 4096, &[(0, 4096, 0)])).unwrap();
        (&a).write_all(b"\n").unwrap();
        let e = PageServer::accept(b, t).err().unwrap();
        assert!(e.to_string().contains("no userfaultfd"), "{e}");
        let (a, b) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            let _ = (&a).write_all(&vec![b'x'; MAX_HANDSHAKE + 2048]);
            a
        });
        let e = PageServer::accept(b, t).err().unwrap();
        assert!(e.to_string().contains("longer than"), "{e}");
        drop(writer.join());
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let e = PageServer::accept(b, t).err().unwrap();
        assert!(e.to_string().contains("closed"), "{e}");
        let (_a, b) = UnixStream::pair().unwrap();
        let e = PageServer::accept(b, Duration::from_millis(50))
            .err()
            .unwrap();
        assert!(e.to_string().contains("none within"), "{e}");
    }
}
