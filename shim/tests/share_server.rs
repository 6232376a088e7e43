//! The file-share server (`share_server`) as the guest meets it: the real
//! shim binary in its serve mode on one end of a socket pair, this test
//! speaking 9P2000.L on the other as a hostile guest would. The jail holds:
//! `..` and symlinks do not leave the shared directory, a device node on
//! it does not open, a read-only share refuses writes whatever is sent,
//! files are created as the container's user, and the server ends cleanly
//! when the connection closes. Needs root (a mount namespace and a
//! chroot); it fails, never skips, without it.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use twig_shim::share_server::{ServeArgs, FILE_CAPS, SERVE_ARG};

const TVERSION: u8 = 100;
const TATTACH: u8 = 104;
const TWALK: u8 = 110;
const TLOPEN: u8 = 12;
const TLCREATE: u8 = 14;
const TREAD: u8 = 116;
const TWRITE: u8 = 118;
const TMKDIR: u8 = 72;
const RLERROR: u8 = 7;
const ROOT_FID: u32 = 1;

/// A 9P2000.L client on the server's connection.
struct Client {
    conn: UnixStream,
    server: Child,
}

/// A message body under construction.
#[derive(Default)]
struct Body(Vec<u8>);

impl Body {
    fn u32(mut self, v: u32) -> Body {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Body {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(mut self, s: &str) -> Body {
        self.0
            .extend_from_slice(&u16::try_from(s.len()).unwrap().to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn data(mut self, d: &[u8]) -> Body {
        self = self.u32(u32::try_from(d.len()).unwrap());
        self.0.extend_from_slice(d);
        self
    }
}

/// What the server answered: its type and body, or the errno of an
/// Rlerror.
type Reply = Result<Vec<u8>, i32>;

impl Client {
    fn start(args: &ServeArgs) -> Client {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let out = theirs.try_clone().unwrap();
        let server = Command::new(env!("CARGO_BIN_EXE_containerd-shim-twig-v2"))
            .arg(SERVE_ARG)
            .args(args.to_args())
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::from(OwnedFd::from(out)))
            .spawn()
            .expect("the shim binary in serve mode");
        ours.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut c = Client { conn: ours, server };
        let v = c
            .call(TVERSION, Body::default().u32(65536).str("9P2000.L"))
            .expect("Tversion");
        assert_eq!(&v[6..14], b"9P2000.L", "the server speaks 9P2000.L");
        c.call(
            TATTACH,
            Body::default()
                .u32(ROOT_FID)
                .u32(u32::MAX)
                .str("root")
                .str("")
                .u32(0),
        )
        .expect("Tattach");
        c
    }

    fn call(&mut self, kind: u8, body: Body) -> Reply {
        let size = u32::try_from(7 + body.0.len()).unwrap();
        let mut msg = size.to_le_bytes().to_vec();
        msg.push(kind);
        msg.extend_from_slice(&1u16.to_le_bytes());
        msg.extend_from_slice(&body.0);
        self.conn.write_all(&msg).expect("sending a request");
        let mut head = [0u8; 7];
        self.conn.read_exact(&mut head).expect("an answer");
        let size = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        let mut rest = vec![0u8; size - 7];
        self.conn.read_exact(&mut rest).expect("the answer's body");
        if head[4] == RLERROR {
            return Err(i32::from_le_bytes(rest[..4].try_into().unwrap()));
        }
        assert_eq!(head[4], kind + 1, "the answer to request {kind}");
        Ok(rest)
    }

    fn walk(&mut self, newfid: u32, names: &[&str]) -> Reply {
        let mut body = Body::default().u32(ROOT_FID).u32(newfid).0.to_vec();
        body.extend_from_slice(&u16::try_from(names.len()).unwrap().to_le_bytes());
        let mut body = Body(body);
        for n in names {
            body = body.str(n);
        }
        let r = self.call(TWALK, body)?;
        // A partial walk is no walk.
        let walked = u16::from_le_bytes([r[0], r[1]]) as usize;
        if walked < names.len() {
            return Err(libc::ENOENT);
        }
        Ok(r)
    }

    fn read_file(&mut self, fid: u32, path: &[&str]) -> Result<Vec<u8>, i32> {
        self.walk(fid, path)?;
        self.call(TLOPEN, Body::default().u32(fid).u32(libc::O_RDONLY as u32))?;
        let r = self.call(TREAD, Body::default().u32(fid).u64(0).u32(4096))?;
        let n = u32::from_le_bytes(r[..4].try_into().unwrap()) as usize;
        Ok(r[4..4 + n].to_vec())
    }

    /// Creates and writes `name` in the root: Tlcreate turns the walked fid
    /// into the open new file.
    fn create(&mut self, fid: u32, name: &str, data: &[u8]) -> Reply {
        self.walk(fid, &[])?;
        self.call(
            TLCREATE,
            Body::default()
                .u32(fid)
                .str(name)
                .u32(libc::O_WRONLY as u32)
                .u32(0o644)
                .u32(0),
        )?;
        self.call(TWRITE, Body::default().u32(fid).u64(0).data(data))
    }

    /// Closes the connection; the server's exit status.
    fn close(self) -> std::process::ExitStatus {
        let Client { conn, mut server } = self;
        drop(conn);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = server.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the server outlived its connection"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn args(dir: &Path, read_only: bool) -> ServeArgs {
    ServeArgs {
        dir: dir.to_path_buf(),
        uid: 1000,
        gid: 1001,
        groups: Vec::new(),
        caps: FILE_CAPS,
        read_only,
    }
}

fn need_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (the file server makes a mount namespace and a chroot)"
    );
}

/// A host tree: `<tmp>/secret` outside the shared `<tmp>/share`, which holds
/// `hello`, a symlink to `/etc` and a device node (`/dev/null`'s).
fn tree() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let share = tmp.path().join("share");
    std::fs::create_dir(&share).unwrap();
    std::fs::write(share.join("hello"), "hello from the host\n").unwrap();
    std::fs::write(tmp.path().join("secret"), "outside\n").unwrap();
    std::os::unix::fs::symlink("/etc", share.join("etc-link")).unwrap();
    let null = std::fs::metadata("/dev/null").unwrap().rdev();
    nix::sys::stat::mknod(
        &share.join("null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        null,
    )
    .unwrap();
    // The container's user may write the share.
    nix::unistd::chown(&share, Some(1000.into()), Some(1001.into())).unwrap();
    tmp
}

#[test]
fn a_guest_stays_inside_the_shared_directory() {
    need_root();
    let tmp = tree();
    let mut c = Client::start(&args(&tmp.path().join("share"), false));
    assert_eq!(
        c.read_file(2, &["hello"]).unwrap(),
        b"hello from the host\n"
    );
    // `..` of the root is the root: the host's parent is out of reach.
    assert_eq!(c.walk(3, &["..", "secret"]), Err(libc::ENOENT));
    assert_eq!(
        c.read_file(4, &["..", "..", "hello"]).unwrap(),
        b"hello from the host\n",
        "`..` stays in the share"
    );
    // A symlink is not followed by the server.
    assert!(c.walk(5, &["etc-link", "passwd"]).is_err());
    // A device node on the share does not open (nodev).
    assert_eq!(c.read_file(6, &["null"]), Err(libc::EACCES));
    // Created files are the container's user's.
    c.create(7, "made", b"by the guest").unwrap();
    let made = std::fs::metadata(tmp.path().join("share/made")).unwrap();
    assert_eq!((made.uid(), made.gid()), (1000, 1001));
    assert_eq!(
        std::fs::read(tmp.path().join("share/made")).unwrap(),
        b"by the guest"
    );
    // A name with `..` in it stays in the share too (the chroot).
    let _ = c.call(
        TMKDIR,
        Body::default()
            .u32(ROOT_FID)
            .str("../../escape")
            .u32(0o755)
            .u32(0),
    );
    assert!(!tmp.path().join("escape").exists());
    assert!(c.close().success(), "a clean end on the guest's close");
}

#[test]
fn a_read_only_share_refuses_every_write() {
    need_root();
    let tmp = tree();
    let mut c = Client::start(&args(&tmp.path().join("share"), true));
    assert_eq!(
        c.read_file(2, &["hello"]).unwrap(),
        b"hello from the host\n"
    );
    assert_eq!(c.create(3, "new", b"x"), Err(libc::EROFS));
    assert!(!tmp.path().join("share/new").exists());
    c.walk(4, &["hello"]).unwrap();
    assert_eq!(
        c.call(TLOPEN, Body::default().u32(4).u32(libc::O_RDWR as u32)),
        Err(libc::EROFS)
    );
    assert!(c.close().success());
}

#[test]
fn garbage_from_the_guest_ends_the_server_not_the_host() {
    need_root();
    let tmp = tree();
    let mut c = Client::start(&args(&tmp.path().join("share"), false));
    // A frame claiming 4 GiB.
    c.conn
        .write_all(&[0xff, 0xff, 0xff, 0xff, 110, 0, 0])
        .unwrap();
    let status = c.close();
    assert!(!status.success(), "refused: {status}");
    assert_eq!(
        std::fs::read(tmp.path().join("share/hello")).unwrap(),
        b"hello from the host\n"
    );
}
