//! The HTTP GET of httpGet probes and hooks, as the kubelet's prober makes
//! it: `kube-probe` as the user agent, redirects followed on the same host
//! only, the body of a redirect kept for its warning, and with `scheme:
//! HTTPS` over TLS without verifying the server (`tls`).

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The user agent of every probe, as the kubelet's (`kube-probe/<major>.<minor>`).
pub(super) const USER_AGENT: &str = "kube-probe/1.37";

/// What an HTTP GET of a probe or hook came to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HttpOutcome {
    /// The final status code.
    Status(u16),
    /// A redirect that was not followed (to another host, or without a
    /// `Location`), with the start of its body.
    Redirected { body: String },
}

/// An HTTP GET for probes and hooks. Like the kubelet's prober, it follows
/// redirects to the same host (at most 10); a redirect elsewhere ends it, a
/// success the kubelet reports with a warning.
pub(super) async fn http_get(
    https: bool,
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> std::io::Result<HttpOutcome> {
    let (mut https, mut port, mut path) = (https, port, path.to_owned());
    for _ in 0..=10 {
        let tcp = tokio::net::TcpStream::connect((host, port)).await?;
        let reply = if https {
            exchange(
                super::tls::connect(host, tcp).await?,
                host,
                port,
                &path,
                headers,
            )
            .await?
        } else {
            exchange(tcp, host, port, &path, headers).await?
        };
        if !(300..400).contains(&reply.code) {
            return Ok(HttpOutcome::Status(reply.code));
        }
        match reply
            .location
            .and_then(|l| local_target(https, host, port, &l))
        {
            Some((s, p, rest)) => (https, port, path) = (s, p, rest),
            None => {
                return Ok(HttpOutcome::Redirected {
                    body: String::from_utf8_lossy(&reply.body).into_owned(),
                });
            }
        }
    }
    Err(std::io::Error::other("stopped after 10 redirects"))
}

/// Where a `Location` leads, when it is on `host`: whether over TLS, its
/// port and path.
fn local_target(https: bool, host: &str, port: u16, location: &str) -> Option<(bool, u16, String)> {
    if location.starts_with('/') {
        return Some((https, port, location.to_owned()));
    }
    let (https, rest) = match location.strip_prefix("http://") {
        Some(rest) => (false, rest),
        None => (true, location.strip_prefix("https://")?),
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (name, port_text) = match authority.strip_prefix('[') {
        Some(inner) => {
            let (h, after) = inner.split_once(']')?;
            (h, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let default = if https { 443 } else { 80 };
    let p = match port_text {
        Some(t) => t.parse().ok()?,
        None => default,
    };
    (name == host).then(|| {
        let path = if path.is_empty() { "/" } else { path };
        (https, p, path.to_owned())
    })
}

/// The parts of an HTTP response a probe uses.
struct Reply {
    code: u16,
    location: Option<String>,
    /// The start of the body (at most 10 KiB), read for a redirect only.
    body: Vec<u8>,
}

/// The most of a redirect's body kept, as the kubelet's prober reads.
const BODY_MAX: usize = 10 << 10;

/// One GET on the connection `s`.
async fn exchange(
    mut s: impl AsyncRead + AsyncWrite + Unpin,
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> std::io::Result<Reply> {
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: {USER_AGENT}\r\nAccept: */*\r\nConnection: close\r\n"
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await?;
    // The status line and headers, up to 16 KiB.
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let end = loop {
        if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(at);
        }
        if head.len() >= 16 << 10 {
            break None;
        }
        let m = read_some(&mut s, &mut buf).await?;
        if m == 0 {
            break None;
        }
        head.extend_from_slice(&buf[..m]);
    };
    let (head, mut body) = match end {
        Some(at) => (head[..at].to_vec(), head[at + 4..].to_vec()),
        None => (head, Vec::new()),
    };
    let text = String::from_utf8_lossy(&head);
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response");
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .filter(|l| l.starts_with("HTTP/"))
        .ok_or_else(bad)?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    let fields: Vec<(&str, &str)> = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim(), v.trim()))
        .collect();
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    };
    let location = field("location").map(str::to_owned);
    if (300..400).contains(&code) && end.is_some() {
        // Up to its length, or to the end of the connection (`Connection: close`).
        let want = field("content-length")
            .and_then(|l| l.parse::<usize>().ok())
            .unwrap_or(BODY_MAX)
            .min(BODY_MAX);
        while body.len() < want {
            let m = read_some(&mut s, &mut buf).await?;
            if m == 0 {
                break;
            }
            body.extend_from_slice(&buf[..m]);
        }
        body.truncate(want);
    } else {
        body.clear();
    }
    Ok(Reply {
        code,
        location,
        body,
    })
}

/// A read where a TLS peer that closes without its close_notify (as many
/// servers do after `Connection: close`) ends the stream, as Go's client
/// takes it.
async fn read_some(s: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> std::io::Result<usize> {
    match s.read(buf).await {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(0),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::local_target;

    #[test]
    fn only_redirects_to_the_same_host_are_followed() {
        assert_eq!(
            local_target(false, "10.0.0.5", 8080, "/healthz"),
            Some((false, 8080, "/healthz".into()))
        );
        assert_eq!(
            local_target(true, "10.0.0.5", 8080, "http://10.0.0.5:9090/x?y=1"),
            Some((false, 9090, "/x?y=1".into()))
        );
        assert_eq!(
            local_target(false, "10.0.0.5", 8080, "http://10.0.0.5"),
            Some((false, 80, "/".into()))
        );
        assert_eq!(
            local_target(false, "10.0.0.5", 8080, "https://10.0.0.5/x"),
            Some((true, 443, "/x".into()))
        );
        assert_eq!(
            local_target(false, "10.0.0.5", 8080, "http://0.0.0.0/healthz"),
            None
        );
        assert_eq!(
            local_target(false, "10.0.0.5", 8080, "ftp://10.0.0.5/"),
            None
        );
        assert_eq!(
            local_target(false, "10.0.0.5", 8080, "http://10.0.0.5:notaport/"),
            None
        );
    }
}
