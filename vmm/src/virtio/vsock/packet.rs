//! The virtio-vsock packet: `struct virtio_vsock_hdr` as a `zerocopy`
//! struct, the operations and flags it carries, and the reading of a guest's
//! transmit chain into a header and its payload (validated: the chain must
//! hold a whole header and the payload the header announces, up to
//! [`MAX_PKT_LEN`]).

use vm_memory::bitmap::BitmapSlice;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use virtio_queue::{DescriptorChain, Writer};

use crate::memory::GuestMem;

/// The host's context id, as the guest addresses it.
pub const HOST_CID: u64 = 2;
/// Size of `struct virtio_vsock_hdr`.
pub const HDR_LEN: usize = std::mem::size_of::<Hdr>();
/// Largest payload of one packet, either way (Linux's limit too).
pub const MAX_PKT_LEN: usize = 64 * 1024;

/// `VIRTIO_VSOCK_TYPE_STREAM`, the only socket type the device carries.
pub const TYPE_STREAM: u16 = 1;
/// Asks the peer to accept a connection.
pub const OP_REQUEST: u16 = 1;
/// Accepts a connection.
pub const OP_RESPONSE: u16 = 2;
/// Ends a connection at once, or refuses it.
pub const OP_RST: u16 = 3;
/// The sender will receive or send no more (see the `SHUTDOWN_*` flags).
pub const OP_SHUTDOWN: u16 = 4;
/// Carries data.
pub const OP_RW: u16 = 5;
/// Tells the peer the sender's credit (`buf_alloc`, `fwd_cnt`).
pub const OP_CREDIT_UPDATE: u16 = 6;
/// Asks the peer for a credit update.
pub const OP_CREDIT_REQUEST: u16 = 7;
/// Shutdown flag: the sender will receive no more.
pub const SHUTDOWN_RCV: u32 = 1;
/// Shutdown flag: the sender will send no more.
pub const SHUTDOWN_SEND: u32 = 2;
/// The one event of the event queue: the guest must drop its connections.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// `struct virtio_vsock_hdr`, little-endian on the wire.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
#[repr(C)]
pub struct Hdr {
    /// Sender's context id.
    pub src_cid: U64,
    /// Receiver's context id.
    pub dst_cid: U64,
    /// Sender's port.
    pub src_port: U32,
    /// Receiver's port.
    pub dst_port: U32,
    /// Payload length.
    pub len: U32,
    /// Socket type (`TYPE_STREAM`).
    pub kind: U16,
    /// Operation (`OP_*`).
    pub op: U16,
    /// Operation flags (`SHUTDOWN_*`).
    pub flags: U32,
    /// Receive buffer the sender has for this connection.
    pub buf_alloc: U32,
    /// Bytes the sender has taken out of that buffer so far.
    pub fwd_cnt: U32,
}

impl Hdr {
    /// A stream packet header for `op` from `(src_cid, src_port)` to
    /// `(dst_cid, dst_port)`, without payload or credit.
    pub fn stream(src: (u64, u32), dst: (u64, u32), op: u16) -> Hdr {
        Hdr {
            src_cid: src.0.into(),
            dst_cid: dst.0.into(),
            src_port: src.1.into(),
            dst_port: dst.1.into(),
            kind: TYPE_STREAM.into(),
            op: op.into(),
            ..Hdr::default()
        }
    }

    /// The reset answering a packet the device cannot take.
    pub fn reset_reply(&self) -> Hdr {
        Hdr::stream(
            (self.dst_cid.get(), self.dst_port.get()),
            (self.src_cid.get(), self.src_port.get()),
            OP_RST,
        )
    }
}

/// Why a guest's transmit chain holds no packet.
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    /// The descriptor chain cannot be read (outside guest memory, a loop…).
    #[error("bad descriptor chain: {0}")]
    Chain(#[source] virtio_queue::Error),
    /// The chain's readable part is shorter than a header.
    #[error("{0} bytes, shorter than a header")]
    ShortHeader(usize),
    /// The header announces more payload than the chain holds or the limit.
    #[error("payload length {len} exceeds the buffer ({avail} bytes) or {MAX_PKT_LEN}")]
    BadLength {
        /// The announced length.
        len: usize,
        /// Readable bytes after the header.
        avail: usize,
    },
    /// Guest memory could not be read.
    #[error("reading the packet: {0}")]
    Read(#[source] std::io::Error),
}

/// A packet from the guest: its header and payload.
#[derive(Debug)]
pub struct Packet {
    /// The header, as the guest wrote it.
    pub hdr: Hdr,
    /// Exactly `hdr.len` bytes.
    pub payload: Vec<u8>,
}

impl Packet {
    /// Reads the guest packet in `chain`.
    pub fn read(chain: DescriptorChain<&GuestMem>, mem: &GuestMem) -> Result<Packet, PacketError> {
        let mut r = chain.reader(mem).map_err(PacketError::Chain)?;
        let avail = r.available_bytes();
        if avail < HDR_LEN {
            return Err(PacketError::ShortHeader(avail));
        }
        let mut hdr = Hdr::default();
        std::io::Read::read_exact(&mut r, hdr.as_mut_bytes()).map_err(PacketError::Read)?;
        let len = hdr.len.get() as usize;
        let avail = r.available_bytes();
        if len > MAX_PKT_LEN || len > avail {
            return Err(PacketError::BadLength { len, avail });
        }
        let mut payload = vec![0u8; len];
        std::io::Read::read_exact(&mut r, &mut payload).map_err(PacketError::Read)?;
        Ok(Packet { hdr, payload })
    }

    /// Writes the packet into a guest receive buffer; the header's `len`
    /// must match the payload.
    pub fn write_to<B: BitmapSlice>(&self, w: &mut Writer<'_, B>) -> std::io::Result<()> {
        std::io::Write::write_all(w, self.hdr.as_bytes())?;
        std::io::Write::write_all(w, &self.payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_has_the_wire_layout() {
        assert_eq!(HDR_LEN, 44);
        let mut h = Hdr::stream((3, 0x0102_0304), (2, 0x0506_0708), OP_RW);
        h.len = 0x1122.into();
        h.flags = SHUTDOWN_SEND.into();
        h.buf_alloc = 0x3344_5566.into();
        h.fwd_cnt = 0x7788_99aa.into();
        let b = h.as_bytes();
        assert_eq!(b[0..8], 3u64.to_le_bytes());
        assert_eq!(b[8..16], 2u64.to_le_bytes());
        assert_eq!(b[16..20], 0x0102_0304u32.to_le_bytes());
        assert_eq!(b[20..24], 0x0506_0708u32.to_le_bytes());
        assert_eq!(b[24..28], 0x1122u32.to_le_bytes());
        assert_eq!(b[28..30], TYPE_STREAM.to_le_bytes());
        assert_eq!(b[30..32], OP_RW.to_le_bytes());
        assert_eq!(b[32..36], SHUTDOWN_SEND.to_le_bytes());
        assert_eq!(b[36..40], 0x3344_5566u32.to_le_bytes());
        assert_eq!(b[40..44], 0x7788_99aau32.to_le_bytes());
        assert_eq!(Hdr::read_from_bytes(b).ok(), Some(h));
        let rst = h.reset_reply();
        assert_eq!(
            (rst.src_cid.get(), rst.src_port.get(), rst.dst_cid.get()),
            (2, 0x0506_0708, 3)
        );
        assert_eq!(
            (rst.op.get(), rst.len.get(), rst.flags.get()),
            (OP_RST, 0, 0)
        );
    }
}
