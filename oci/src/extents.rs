//! The extents blob: a file's non-zero pages, or the pages in which it
//! differs from a base file, in one deterministic stream (the same file
//! always encodes to the same bytes, so to the same digest).
//!
//! ```text
//! header   "TWIGEXT2" | length u64            the decoded file's length
//! record*  offset u64 | len u64 | data[len]   ascending, disjoint, page-aligned offsets
//! end      u64::MAX   | 0
//! index    (offset u64 | len u64 | at u64 | sha256 [32])*
//!                                             each record's range, its position in the
//!                                             blob and the SHA-256 of its data
//! footer   records u64 | index_at u64 | "TWIGEXT2"
//! ```
//!
//! All integers little-endian. Decoding writes the records into a file of
//! `length` bytes that starts as the base (a reflink of it) or empty (all
//! zeros, holes), so what is not in a record is the base's or zero. The
//! index and footer let a reader fetch one range of the file by blob
//! offset without reading the records before it ([`Index`]); the push puts
//! the index's position and digest in the layer's annotations, so a range
//! fetched alone is verified as the whole blob is (manifest → index →
//! record). Records are at most [`MAX_RECORD`]: the unit a lazy restore
//! fetches. `TWIGEXT1` blobs (no record digests) are refused.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

use sha2::{Digest, Sha256};

use crate::client::hex;
use crate::error::{Error, Result};

/// The blob's magic, at both ends.
pub const MAGIC: &[u8; 8] = b"TWIGEXT2";
/// The previous format's magic (records without digests): refused.
const OLD_MAGIC: &[u8; 8] = b"TWIGEXT1";
/// The unit of comparison: a page.
const PAGE: u64 = 4096;
/// Longest record: adjacent changed pages are joined up to this. What a
/// lazy restore fetches for one fault (a record is verified whole).
pub const MAX_RECORD: u64 = 256 << 10;
/// How much is read at once while comparing.
const SCAN: u64 = 1 << 20;
/// End-of-records marker's offset.
const END: u64 = u64::MAX;
const HEADER: u64 = 16;
const RECORD_HEADER: u64 = 16;
const INDEX_ENTRY: u64 = 56;
const FOOTER: u64 = 24;
/// Largest index (and footer) accepted, in bytes: 2^20 records.
pub const MAX_INDEX: u64 = (1 << 20) * INDEX_ENTRY + FOOTER;

/// What a file encodes to: its length and the ranges to carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The file's length.
    pub length: u64,
    /// `(offset, len)` of each record, ascending and disjoint.
    pub ranges: Vec<(u64, u64)>,
}

impl Plan {
    /// Compares `file` with `base` (or with zeros) page by page over the
    /// ranges where either holds data, and keeps the pages that differ.
    pub fn of(file: &File, base: Option<&File>) -> io::Result<Plan> {
        let length = file.metadata()?.len();
        let base_len = match base {
            Some(b) => b.metadata()?.len(),
            None => 0,
        };
        let mut data = data_ranges(file, length)?;
        if let Some(b) = base {
            data.extend(data_ranges(b, base_len.min(length))?);
        }
        let data = merge(data);
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut ours = vec![0u8; SCAN as usize];
        let mut theirs = vec![0u8; SCAN as usize];
        for (start, end) in data {
            let mut at = start;
            while at < end {
                let n = (end - at).min(SCAN) as usize;
                file.read_exact_at(&mut ours[..n], at)?;
                read_or_zero(base, base_len, &mut theirs[..n], at)?;
                for (i, (a, b)) in ours[..n]
                    .chunks(PAGE as usize)
                    .zip(theirs[..n].chunks(PAGE as usize))
                    .enumerate()
                {
                    if a != b {
                        let off = at + i as u64 * PAGE;
                        push_range(&mut ranges, off, a.len() as u64);
                    }
                }
                at += n as u64;
            }
        }
        Ok(Plan { length, ranges })
    }

    /// The encoded blob's size in bytes.
    pub fn blob_len(&self) -> u64 {
        let n = self.ranges.len() as u64;
        self.index_at() + n * INDEX_ENTRY + FOOTER
    }

    /// Where the encoded blob's index starts.
    pub fn index_at(&self) -> u64 {
        let n = self.ranges.len() as u64;
        HEADER + n * RECORD_HEADER + self.data_bytes() + RECORD_HEADER
    }

    /// The bytes of the file the records carry.
    pub fn data_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// A reader of the encoded blob, reading `file`'s pages as it goes
    /// (and hashing each record for the index at its end).
    pub fn reader<'a>(&'a self, file: &'a File) -> BlobReader<'a> {
        let mut pieces = Vec::with_capacity(self.ranges.len() * 2 + 2);
        let mut head = MAGIC.to_vec();
        head.extend(self.length.to_le_bytes());
        pieces.push(Piece::Bytes(head));
        for &(off, len) in &self.ranges {
            let mut h = off.to_le_bytes().to_vec();
            h.extend(len.to_le_bytes());
            pieces.push(Piece::Bytes(h));
            pieces.push(Piece::File(off, len));
        }
        pieces.push(Piece::Tail);
        BlobReader {
            plan: self,
            file,
            pieces,
            piece: 0,
            within: 0,
            hasher: Sha256::new(),
            digests: Vec::with_capacity(self.ranges.len()),
            index_digest: None,
        }
    }

    /// The end marker, index and footer, given each record's digest.
    fn tail(&self, digests: &[[u8; 32]]) -> Vec<u8> {
        let mut tail = END.to_le_bytes().to_vec();
        tail.extend(0u64.to_le_bytes());
        let mut at = HEADER;
        for (&(off, len), d) in self.ranges.iter().zip(digests) {
            tail.extend(off.to_le_bytes());
            tail.extend(len.to_le_bytes());
            tail.extend(at.to_le_bytes());
            tail.extend(d);
            at += RECORD_HEADER + len;
        }
        tail.extend((self.ranges.len() as u64).to_le_bytes());
        tail.extend(self.index_at().to_le_bytes());
        tail.extend(MAGIC);
        tail
    }
}

fn read_or_zero(base: Option<&File>, base_len: u64, buf: &mut [u8], at: u64) -> io::Result<()> {
    buf.fill(0);
    if let Some(b) = base {
        if at < base_len {
            let n = ((base_len - at) as usize).min(buf.len());
            b.read_exact_at(&mut buf[..n], at)?;
        }
    }
    Ok(())
}

fn push_range(ranges: &mut Vec<(u64, u64)>, off: u64, len: u64) {
    if let Some(last) = ranges.last_mut() {
        if last.0 + last.1 == off && last.1 + len <= MAX_RECORD {
            last.1 += len;
            return;
        }
    }
    ranges.push((off, len));
}

/// `(start, end)` ranges of `file` below `limit` that hold data (not
/// holes), page-aligned outwards.
fn data_ranges(file: &File, limit: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut at: u64 = 0;
    while at < limit {
        // SAFETY: lseek on a file descriptor this function borrows.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let (start, end) = (data as u64, (hole as u64).min(limit));
        if start >= limit {
            break;
        }
        out.push((
            start / PAGE * PAGE,
            end.div_ceil(PAGE).saturating_mul(PAGE).min(limit),
        ));
        at = end.max(start + 1);
    }
    Ok(out)
}

fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

enum Piece {
    Bytes(Vec<u8>),
    File(u64, u64),
    /// The end marker, index and footer: made once every record is hashed.
    Tail,
}

/// The encoded blob as a stream ([`Plan::reader`]).
pub struct BlobReader<'a> {
    plan: &'a Plan,
    file: &'a File,
    pieces: Vec<Piece>,
    piece: usize,
    within: u64,
    hasher: Sha256,
    digests: Vec<[u8; 32]>,
    index_digest: Option<String>,
}

impl BlobReader<'_> {
    /// `sha256:<hex>` of the index and footer (the blob's bytes from
    /// [`Plan::index_at`] to its end), once the reader has reached them.
    pub fn index_digest(&self) -> Option<&str> {
        self.index_digest.as_deref()
    }
}

impl Read for BlobReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while let Some(p) = self.pieces.get_mut(self.piece) {
            if matches!(p, Piece::Tail) {
                let tail = self.plan.tail(&self.digests);
                let index = &tail[RECORD_HEADER as usize..];
                self.index_digest = Some(format!("sha256:{}", hex(&Sha256::digest(index))));
                *p = Piece::Bytes(tail);
            }
            let (len, n) = match &self.pieces[self.piece] {
                Piece::Bytes(b) => {
                    let rest = &b[self.within as usize..];
                    let n = rest.len().min(buf.len());
                    buf[..n].copy_from_slice(&rest[..n]);
                    (b.len() as u64, n)
                }
                Piece::File(off, len) => {
                    let want = ((len - self.within) as usize).min(buf.len());
                    let n = self.file.read_at(&mut buf[..want], off + self.within)?;
                    if n == 0 && want > 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the file shrank while it was being encoded",
                        ));
                    }
                    self.hasher.update(&buf[..n]);
                    (*len, n)
                }
                Piece::Tail => (0, 0),
            };
            self.within += n as u64;
            if self.within == len {
                if matches!(self.pieces[self.piece], Piece::File(..)) {
                    let h = std::mem::take(&mut self.hasher).finalize();
                    self.digests.push(h.into());
                }
                self.piece += 1;
                self.within = 0;
            }
            if n > 0 {
                return Ok(n);
            }
        }
        Ok(0)
    }
}

/// One record as the index lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// Its offset in the decoded file.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// Where its header is in the blob (its data follows, 16 bytes on).
    pub at: u64,
    /// SHA-256 of its data.
    pub sha256: [u8; 32],
}

impl IndexEntry {
    /// The blob's byte range of its data: `(start, len)`.
    pub fn data_range(&self) -> (u64, u64) {
        (self.at + RECORD_HEADER, self.len)
    }

    /// Whether `data` is this record's data.
    pub fn verify(&self, data: &[u8]) -> bool {
        data.len() as u64 == self.len && Sha256::digest(data).as_slice() == self.sha256
    }
}

/// An extents blob's index: every record's range, position and digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    /// The decoded file's length.
    pub length: u64,
    /// The records, ascending.
    pub entries: Vec<IndexEntry>,
}

impl Index {
    /// Parses the blob's bytes from `index_at` to its end (`blob_size`
    /// bytes in all), checking them against what the manifest says: the
    /// position, the file's `length`, and a structure consistent with the
    /// records before it (positions, order, alignment). The caller checks
    /// the bytes' digest first.
    pub fn parse(tail: &[u8], index_at: u64, blob_size: u64, length: u64) -> Result<Index> {
        let bad = |what: String| Error::Corrupt(format!("extents index: {what}"));
        if blob_size.checked_sub(index_at) != Some(tail.len() as u64)
            || (tail.len() as u64) < FOOTER
            || tail.len() as u64 > MAX_INDEX
        {
            return Err(bad(format!(
                "{} bytes at {index_at} of a {blob_size}-byte blob",
                tail.len()
            )));
        }
        let foot = &tail[tail.len() - FOOTER as usize..];
        if &foot[16..] == OLD_MAGIC {
            return Err(bad(old_format()));
        }
        let n = u64_at(foot, 0);
        if &foot[16..] != MAGIC
            || u64_at(foot, 8) != index_at
            || n.checked_mul(INDEX_ENTRY) != Some(tail.len() as u64 - FOOTER)
        {
            return Err(bad("its footer disagrees with its position or size".into()));
        }
        let mut entries = Vec::with_capacity(n as usize);
        let (mut at, mut next) = (HEADER, 0u64);
        for e in tail[..tail.len() - FOOTER as usize].chunks_exact(INDEX_ENTRY as usize) {
            let (offset, len, pos) = (u64_at(e, 0), u64_at(e, 8), u64_at(e, 16));
            let end = offset.checked_add(len).filter(|e| *e <= length);
            if pos != at || len == 0 || len > MAX_RECORD || offset % PAGE != 0 || offset < next {
                return Err(bad(format!("record at {offset}+{len} is malformed")));
            }
            next =
                end.ok_or_else(|| bad(format!("record at {offset}+{len} is beyond the file")))?;
            let mut sha256 = [0u8; 32];
            sha256.copy_from_slice(&e[24..56]);
            entries.push(IndexEntry {
                offset,
                len,
                at,
                sha256,
            });
            at += RECORD_HEADER + len;
        }
        if at + RECORD_HEADER != index_at {
            return Err(bad("its records do not end where it starts".into()));
        }
        Ok(Index { length, entries })
    }

    /// The record holding byte `offset` of the file, if any.
    pub fn find(&self, offset: u64) -> Option<usize> {
        let i = self.entries.partition_point(|e| e.offset + e.len <= offset);
        self.entries
            .get(i)
            .filter(|e| e.offset <= offset)
            .map(|_| i)
    }
}

fn old_format() -> String {
    "an extents blob of the older TWIGEXT1 format (no record digests): push the snapshot again"
        .into()
}

/// What [`decode`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    /// The file's length.
    pub length: u64,
    /// Bytes written from records.
    pub data_bytes: u64,
}

/// Decodes an extents blob from `r` into `out` (the base's reflink, or an
/// empty file), refusing anything malformed: a wrong magic, a length other
/// than `expected_len`, records out of order, overlapping, unaligned,
/// beyond the length or too long, an index that disagrees with them (or a
/// record's data with its digest), trailing bytes.
pub fn decode(r: impl Read, out: &File, expected_len: u64) -> Result<Decoded> {
    decode_with(r, out, expected_len, None, &mut |_| {})
}

/// [`decode`], checking each record against `index` (verified beforehand)
/// before it is written, and calling `written(i)` once record `i` is in
/// `out`: what a lazy restore serves from `out` from then on.
pub fn decode_with(
    mut r: impl Read,
    out: &File,
    expected_len: u64,
    index: Option<&Index>,
    written: &mut dyn FnMut(usize),
) -> Result<Decoded> {
    let bad = |what: String| Error::Corrupt(format!("extents blob: {what}"));
    let mut head = [0u8; HEADER as usize];
    read_full(&mut r, &mut head)?;
    if &head[..8] == OLD_MAGIC {
        return Err(bad(old_format()));
    }
    if &head[..8] != MAGIC {
        return Err(bad("not an extents blob (bad magic)".into()));
    }
    let length = u64_at(&head, 8);
    if length != expected_len {
        return Err(bad(format!(
            "it decodes to {length} bytes, the snapshot's manifest says {expected_len}"
        )));
    }
    out.set_len(length)
        .map_err(Error::local("sizing a pulled file"))?;
    let mut seen: Vec<IndexEntry> = Vec::new();
    let mut at = HEADER;
    let mut next = 0u64;
    let mut data_bytes = 0u64;
    let mut buf = vec![0u8; MAX_RECORD as usize];
    loop {
        let mut rh = [0u8; RECORD_HEADER as usize];
        read_full(&mut r, &mut rh)?;
        let (off, len) = (u64_at(&rh, 0), u64_at(&rh, 8));
        if off == END && len == 0 {
            break;
        }
        if len == 0 || len > MAX_RECORD || off % PAGE != 0 || off < next {
            return Err(bad(format!(
                "record at {off}+{len} is out of order or malformed"
            )));
        }
        let end = off
            .checked_add(len)
            .filter(|e| *e <= length)
            .ok_or_else(|| {
                bad(format!(
                    "record at {off}+{len} is beyond the file's {length} bytes"
                ))
            })?;
        let data = &mut buf[..len as usize];
        read_full(&mut r, data)?;
        let entry = IndexEntry {
            offset: off,
            len,
            at,
            sha256: Sha256::digest(&*data).into(),
        };
        if let Some(index) = index {
            if index.entries.get(seen.len()) != Some(&entry) {
                return Err(bad(format!(
                    "record at {off}+{len} (blob bytes {at}..) is not what its verified index says"
                )));
            }
        }
        out.write_all_at(data, off)
            .map_err(Error::local("writing a pulled file"))?;
        seen.push(entry);
        written(seen.len() - 1);
        data_bytes += len;
        next = end;
        at += RECORD_HEADER + len;
    }
    let index_at = at + RECORD_HEADER;
    for s in &seen {
        let mut e = [0u8; INDEX_ENTRY as usize];
        read_full(&mut r, &mut e)?;
        if (u64_at(&e, 0), u64_at(&e, 8), u64_at(&e, 16)) != (s.offset, s.len, s.at)
            || e[24..] != s.sha256
        {
            return Err(bad(format!(
                "its index disagrees with record {}+{}",
                s.offset, s.len
            )));
        }
    }
    let mut foot = [0u8; FOOTER as usize];
    read_full(&mut r, &mut foot)?;
    if u64_at(&foot, 0) != seen.len() as u64 || u64_at(&foot, 8) != index_at || &foot[16..] != MAGIC
    {
        return Err(bad("its footer disagrees with its records".into()));
    }
    if index.is_some_and(|i| i.entries.len() != seen.len()) {
        return Err(bad("it has fewer records than its verified index".into()));
    }
    let mut extra = [0u8; 1];
    if r.read(&mut extra).map_err(read_err)? != 0 {
        return Err(bad("bytes after its footer".into()));
    }
    Ok(Decoded { length, data_bytes })
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<()> {
    r.read_exact(buf).map_err(read_err)
}

fn read_err(e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        Error::Corrupt("extents blob: it ends early".into())
    } else {
        Error::Transfer(format!("reading a blob: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    fn file_with(len: u64, writes: &[(u64, &[u8])]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        for (at, b) in writes {
            f.seek(SeekFrom::Start(*at)).unwrap();
            f.write_all(b).unwrap();
        }
        f
    }

    fn round_trip(file: &File, base: Option<&File>) -> (Plan, Vec<u8>, File) {
        let plan = Plan::of(file, base).unwrap();
        let mut blob = Vec::new();
        plan.reader(file).read_to_end(&mut blob).unwrap();
        assert_eq!(blob.len() as u64, plan.blob_len());
        let out = tempfile::tempfile().unwrap();
        if let Some(b) = base {
            out.write_all_at(&contents(b), 0).unwrap();
        }
        let d = decode(&blob[..], &out, plan.length).unwrap();
        assert_eq!(d.data_bytes, plan.data_bytes());
        (plan, blob, out)
    }

    fn contents(f: &File) -> Vec<u8> {
        let mut v = vec![0u8; f.metadata().unwrap().len() as usize];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    }

    #[test]
    fn only_non_zero_pages_are_carried_and_the_file_comes_back_whole() {
        let f = file_with(
            1 << 20,
            &[(5000, b"hello"), (3 * 4096, &[0u8; 4096]), (900_000, b"x")],
        );
        let (plan, _, out) = round_trip(&f, None);
        assert_eq!(plan.ranges, vec![(4096, 4096), (219 * 4096, 4096)]);
        assert!(contents(&out) == contents(&f), "decoded file differs");
    }

    #[test]
    fn a_delta_carries_only_the_pages_that_differ_from_its_base() {
        let base = file_with(64 * 4096, &[(0, &[7u8; 64 * 4096])]);
        let mut child_bytes = vec![7u8; 64 * 4096];
        child_bytes[10 * 4096] = 1; // changed
        child_bytes[11 * 4096..12 * 4096].fill(0); // zeroed: must be carried
        let child = file_with(70 * 4096, &[(0, &child_bytes), (69 * 4096, b"grown")]);
        let (plan, _, out) = round_trip(&child, Some(&base));
        assert_eq!(plan.ranges, vec![(10 * 4096, 2 * 4096), (69 * 4096, 4096)]);
        assert!(contents(&out) == contents(&child), "decoded file differs");
    }

    #[test]
    fn the_same_file_encodes_to_the_same_bytes() {
        let f = file_with(1 << 16, &[(0, b"a"), (40_000, b"b")]);
        let (_, a, _) = round_trip(&f, None);
        let (_, b, _) = round_trip(&f, None);
        assert!(a == b, "encodings differ");
    }

    #[test]
    fn malformed_blobs_are_refused() {
        let f = file_with(3 * 4096, &[(0, b"a"), (8192, b"b")]);
        let plan = Plan::of(&f, None).unwrap();
        let mut blob = Vec::new();
        plan.reader(&f).read_to_end(&mut blob).unwrap();
        let out = tempfile::tempfile().unwrap();
        let refused = |b: &[u8], len: u64| decode(b, &out, len).unwrap_err().to_string();
        assert!(
            refused(&blob, 4096).contains("manifest says"),
            "wrong length"
        );
        assert!(refused(&blob[..blob.len() - 1], plan.length).contains("ends early"));
        let mut extra = blob.clone();
        extra.push(0);
        assert!(refused(&extra, plan.length).contains("after its footer"));
        let mut magic = blob.clone();
        magic[0] = b'X';
        assert!(refused(&magic, plan.length).contains("bad magic"));
        let mut beyond = blob.clone();
        beyond[16..24].copy_from_slice(&(4 * 4096u64).to_le_bytes());
        assert!(refused(&beyond, plan.length).contains("beyond"));
        let mut unaligned = blob.clone();
        unaligned[16..24].copy_from_slice(&1u64.to_le_bytes());
        assert!(refused(&unaligned, plan.length).contains("malformed"));
        let mut index = blob.clone();
        let at = blob.len() - 24 - 56 * 2;
        index[at] ^= 1;
        assert!(refused(&index, plan.length).contains("index"));
        let mut digest = blob.clone();
        let at = blob.len() - 24 - 1;
        digest[at] ^= 1;
        assert!(refused(&digest, plan.length).contains("index"));
        let mut data = blob.clone();
        data[32] ^= 1;
        assert!(refused(&data, plan.length).contains("index"));
        let mut old = blob.clone();
        old[..8].copy_from_slice(b"TWIGEXT1");
        assert!(refused(&old, plan.length).contains("TWIGEXT1"));
    }

    #[test]
    fn the_index_locates_and_verifies_every_record() {
        // 1 MiB of data in one run: split into records of MAX_RECORD.
        let f = file_with(
            4 << 20,
            &[(0, &[3u8; 1 << 20]), (2 << 20, b"x"), (3 << 20, b"y")],
        );
        let plan = Plan::of(&f, None).unwrap();
        assert_eq!(plan.ranges.len(), 4 + 2, "{:?}", plan.ranges);
        assert!(plan.ranges.iter().all(|r| r.1 <= MAX_RECORD));
        let mut reader = plan.reader(&f);
        let mut blob = Vec::new();
        reader.read_to_end(&mut blob).unwrap();
        let at = plan.index_at();
        let digest = reader.index_digest().unwrap().to_string();
        let tail = &blob[at as usize..];
        assert_eq!(digest, crate::client::digest_of(tail));
        let index = Index::parse(tail, at, blob.len() as u64, plan.length).unwrap();
        assert_eq!(index.entries.len(), 6);
        for (e, r) in index.entries.iter().zip(&plan.ranges) {
            assert_eq!((e.offset, e.len), *r);
            let (start, len) = e.data_range();
            let data = &blob[start as usize..(start + len) as usize];
            assert!(e.verify(data));
            assert!(!e.verify(&data[1..]));
        }
        assert_eq!(index.find(5000), Some(0));
        assert_eq!(index.find((1 << 20) - 1), Some(3));
        assert_eq!(index.find(1 << 20), None);
        assert_eq!(index.find((2 << 20) + 4095), Some(4));
        assert_eq!(index.find(4 << 20), None);
        // Checked against what the manifest says.
        let e = |r: Result<Index>| r.unwrap_err().to_string();
        assert!(e(Index::parse(tail, at + 1, blob.len() as u64, plan.length)).contains("bytes at"));
        assert!(e(Index::parse(tail, at, blob.len() as u64, 1 << 20)).contains("beyond"));
        let mut moved = tail.to_vec();
        moved[16] ^= 1;
        assert!(e(Index::parse(&moved, at, blob.len() as u64, plan.length)).contains("malformed"));
        // Decoding against the verified index: each record reported once
        // written, in order.
        let out = tempfile::tempfile().unwrap();
        let mut written = Vec::new();
        decode_with(&blob[..], &out, plan.length, Some(&index), &mut |i| {
            written.push(i)
        })
        .unwrap();
        assert_eq!(written, (0..6).collect::<Vec<_>>());
        assert!(contents(&out) == contents(&f));
        let mut other = index.clone();
        other.entries[2].sha256[0] ^= 1;
        let err = decode_with(&blob[..], &out, plan.length, Some(&other), &mut |i| {
            assert!(i < 2, "record {i} written past a mismatch")
        })
        .unwrap_err();
        assert!(err.to_string().contains("verified index"), "{err}");
    }
}
