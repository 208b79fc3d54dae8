//! SPDY/3 header blocks: a count and length-prefixed name/value pairs,
//! compressed with zlib and the SPDY/3 dictionary. One compression context per
//! direction lasts the whole connection, with a sync flush after each block.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The SPDY/3 zlib dictionary (1423 bytes, from the SPDY/3 draft).
pub const DICTIONARY: &[u8] = include_bytes!("dictionary.bin");

/// The largest decompressed header block accepted.
pub const MAX_BLOCK: usize = 64 * 1024;
const MAX_HEADERS: u32 = 256;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header block is not valid zlib: {0}")]
    Zlib(String),
    #[error("header block decompresses past {MAX_BLOCK} bytes")]
    TooLarge,
    #[error("header block is malformed: {0}")]
    Malformed(&'static str),
}

pub type Headers = Vec<(String, String)>;

/// Looks up a header by (lowercase) name.
pub fn get<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

#[derive(Debug)]
pub struct HeaderDecoder {
    z: Decompress,
}

impl Default for HeaderDecoder {
    fn default() -> Self {
        Self {
            z: Decompress::new(true),
        }
    }
}

impl HeaderDecoder {
    pub fn decode(&mut self, block: &[u8]) -> Result<Headers, HeaderError> {
        let mut out: Vec<u8> = Vec::with_capacity(block.len() * 4);
        let mut input = block;
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            let before_in = self.z.total_in();
            let before_out = self.z.total_out();
            let result = self.z.decompress(input, &mut chunk, FlushDecompress::Sync);
            let used = usize::try_from(self.z.total_in() - before_in).unwrap_or(input.len());
            let made = usize::try_from(self.z.total_out() - before_out).unwrap_or(0);
            input = &input[used.min(input.len())..];
            out.extend_from_slice(&chunk[..made]);
            if out.len() > MAX_BLOCK {
                return Err(HeaderError::TooLarge);
            }
            match result {
                Ok(Status::StreamEnd) => break,
                Ok(_) if input.is_empty() && made < chunk.len() => break,
                Ok(_) if used == 0 && made == 0 => break,
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.z
                        .set_dictionary(DICTIONARY)
                        .map_err(|e| HeaderError::Zlib(e.to_string()))?;
                }
                Err(e) => return Err(HeaderError::Zlib(e.to_string())),
            }
        }
        parse_block(&out)
    }
}

/// Reads length-prefixed fields from a decompressed block, never past its end.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], HeaderError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(HeaderError::Malformed("length overflow"))?;
        let s = self
            .b
            .get(self.pos..end)
            .ok_or(HeaderError::Malformed("truncated block"))?;
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, HeaderError> {
        self.take(4)
            .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn string(&mut self) -> Result<String, HeaderError> {
        let len = self.u32()? as usize;
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| HeaderError::Malformed("not UTF-8"))
    }
}

fn parse_block(b: &[u8]) -> Result<Headers, HeaderError> {
    let mut c = Cursor { b, pos: 0 };
    let count = c.u32()?;
    if count > MAX_HEADERS {
        return Err(HeaderError::Malformed("too many headers"));
    }
    let mut headers = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let name = c.string()?;
        let value = c.string()?;
        if name.is_empty() {
            return Err(HeaderError::Malformed("empty header name"));
        }
        headers.push((name.to_ascii_lowercase(), value));
    }
    Ok(headers)
}

#[derive(Debug)]
pub struct HeaderEncoder {
    z: Compress,
    started: bool,
}

impl Default for HeaderEncoder {
    fn default() -> Self {
        Self {
            z: Compress::new(Compression::best(), true),
            started: false,
        }
    }
}

impl HeaderEncoder {
    pub fn encode(&mut self, headers: &[(&str, &str)]) -> Result<Vec<u8>, HeaderError> {
        if !self.started {
            self.z
                .set_dictionary(DICTIONARY)
                .map_err(|e| HeaderError::Zlib(e.to_string()))?;
            self.started = true;
        }
        let mut raw = Vec::new();
        raw.extend_from_slice(&u32::try_from(headers.len()).unwrap_or(0).to_be_bytes());
        for (n, v) in headers {
            for part in [n.to_ascii_lowercase(), (*v).to_owned()] {
                raw.extend_from_slice(&u32::try_from(part.len()).unwrap_or(0).to_be_bytes());
                raw.extend_from_slice(part.as_bytes());
            }
        }
        let mut out = Vec::with_capacity(raw.len() + 64);
        let mut input = &raw[..];
        loop {
            out.reserve(256);
            let before = self.z.total_in();
            self.z
                .compress_vec(input, &mut out, FlushCompress::Sync)
                .map_err(|e| HeaderError::Zlib(e.to_string()))?;
            let used = usize::try_from(self.z.total_in() - before).unwrap_or(input.len());
            input = &input[used.min(input.len())..];
            if input.is_empty() && out.len() < out.capacity() {
                break;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_roundtrip_on_one_context() {
        let mut enc = HeaderEncoder::default();
        let mut dec = HeaderDecoder::default();
        for i in 0..3 {
            let port = i.to_string();
            let block = enc
                .encode(&[("streamType", "data"), ("port", &port)])
                .unwrap();
            let h = dec.decode(&block).unwrap();
            assert_eq!(get(&h, "streamtype"), Some("data"));
            assert_eq!(get(&h, "port"), Some(port.as_str()));
        }
    }

    #[test]
    fn garbage_is_an_error() {
        let mut dec = HeaderDecoder::default();
        assert!(dec.decode(b"\x00\x01\x02garbage").is_err());
        assert!(parse_block(&[0, 0, 0, 1, 0, 0, 0, 9, b'a']).is_err());
        assert!(parse_block(&[0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
