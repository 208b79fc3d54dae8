//! Where one request of a probe's chain goes, as Go's `net/url` reads it:
//! the first URL from the action (`formatURL`), a redirect's `Location`
//! resolved against it, and a path that Go's parser would refuse (a control
//! character) refused in its words.

use super::Get;

/// Where one request of a chain goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Target {
    /// Lower case; only `http` and `https` are ever connected to.
    pub(super) scheme: String,
    /// The host connected to (an IPv6 address without its brackets).
    pub(super) host: String,
    pub(super) port: u16,
    /// The URL's authority as written: the request's `Host` unless the action
    /// names one.
    pub(super) authority: String,
    /// The request-target (origin form), valid as an `http::Uri`.
    pub(super) target: String,
}

impl Target {
    /// The first request, as the kubelet's `NewRequestForHTTPGetAction`
    /// makes its URL (`formatURL`).
    pub(super) fn first(get: &Get<'_>) -> Result<Self, String> {
        let scheme = if get.https { "https" } else { "http" };
        let target = request_target(get.path)?;
        let authority = super::super::handler::authority(get.host, get.port);
        // Go escapes what a host cannot hold, then refuses to parse the URL
        // it made: an ASCII byte escaped is an invalid escape in a host.
        if let Some(b) = authority
            .bytes()
            .find(|b| b.is_ascii() && *b != b'%' && !host_byte(*b))
        {
            let escaped: String = authority
                .bytes()
                .map(|b| {
                    if host_byte(b) {
                        char::from(b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            return Err(format!(
                "parse \"{scheme}://{escaped}{target}\": invalid URL escape \"%{b:02X}\""
            ));
        }
        Ok(Self {
            scheme: scheme.into(),
            host: get.host.to_owned(),
            port: get.port,
            authority,
            target,
        })
    }

    /// The URL, as Go's client names it in its errors.
    pub(super) fn url(&self) -> String {
        format!("{}://{}{}", self.scheme, self.authority, self.target)
    }

    /// Where `location` leads from here: resolved against this URL as Go's
    /// client resolves a redirect's (RFC 3986, section 5.2).
    pub(super) fn resolve(&self, location: &str) -> Result<Self, String> {
        if location.bytes().any(is_ctl) {
            return Err(format!(
                "parse {location:?}: net/url: invalid control character in URL"
            ));
        }
        let reference = location.split('#').next().unwrap_or_default();
        let (scheme, rest) = match scheme_of(reference) {
            Some((s, rest)) => (s.to_ascii_lowercase(), rest),
            None => (self.scheme.clone(), reference),
        };
        if let Some(after) = rest.strip_prefix("//") {
            let end = after.find(['/', '?']).unwrap_or(after.len());
            let (authority, path) = after.split_at(end);
            let (host, port) = split_authority(&scheme, authority)?;
            return Ok(Self {
                authority: authority.rsplit('@').next().unwrap_or_default().to_owned(),
                target: request_target(path)?,
                scheme,
                host,
                port,
            });
        }
        if scheme_of(reference).is_some() {
            // `scheme:opaque`: no host of its own, so none the prober follows.
            return Ok(Self {
                scheme,
                host: String::new(),
                port: 0,
                authority: String::new(),
                target: "/".into(),
            });
        }
        let current = self.target.split('?').next().unwrap_or("/");
        let target = if rest.is_empty() {
            self.target.clone()
        } else if rest.starts_with('/') {
            request_target(rest)?
        } else if let Some(query) = rest.strip_prefix('?') {
            request_target(&format!("{current}?{query}"))?
        } else {
            // A relative path: beside the current one.
            let dir = &current[..current.rfind('/').map_or(0, |i| i + 1)];
            request_target(&remove_dots(&format!("{dir}{rest}")))?
        };
        Ok(Self {
            scheme: self.scheme.clone(),
            host: self.host.clone(),
            port: self.port,
            authority: self.authority.clone(),
            target,
        })
    }
}

/// The host and port of an authority (`user@host:port`, `[v6]:port`), the
/// port the scheme's own when it names none.
pub(super) fn split_authority(scheme: &str, authority: &str) -> Result<(String, u16), String> {
    let hostport = authority.rsplit('@').next().unwrap_or_default();
    let (host, port) = match hostport.strip_prefix('[') {
        Some(inner) => {
            let (h, after) = inner
                .split_once(']')
                .ok_or_else(|| format!("parse {authority:?}: missing ']' in host"))?;
            (h, after.strip_prefix(':'))
        }
        None => match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        },
    };
    let port = match port.filter(|p| !p.is_empty()) {
        Some(p) => p
            .parse()
            .map_err(|_| format!("invalid port \":{p}\" after host"))?,
        None if scheme == "https" => 443,
        None => 80,
    };
    Ok((host.to_owned(), port))
}

/// `reference`'s scheme (RFC 3986: a letter, then letters, digits, `+-.`)
/// and what follows its colon.
pub(super) fn scheme_of(reference: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = reference.split_once(':')?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some((scheme, rest))
}

pub(super) fn has_scheme(reference: &str) -> bool {
    scheme_of(reference).is_some()
}

/// `path` without its `.` and `..` segments (RFC 3986, section 5.2.4).
pub(super) fn remove_dots(path: &str) -> String {
    let (path, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    };
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').collect();
    for (i, s) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        match *s {
            "." if last => out.push(""),
            "." => {}
            ".." => {
                if out.len() > 1 {
                    out.pop();
                }
                if last {
                    out.push("");
                }
            }
            s => out.push(s),
        }
    }
    let mut joined = out.join("/");
    if !joined.starts_with('/') {
        joined.insert(0, '/');
    }
    match query {
        Some(q) => format!("{joined}?{q}"),
        None => joined,
    }
}

/// A control character: what Go's URL parser refuses anywhere in a URL, and
/// what no header value may hold but a tab.
pub(super) fn is_ctl(b: u8) -> bool {
    b < b' ' || b == 0x7f
}

/// A byte Go's client sends in a `Host` header (`httpguts.ValidHostHeader`).
pub(super) fn host_header_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!$%&'()*+,-.:;=[]_~".contains(&b)
}

/// A byte Go's URL writer leaves as it is in a host.
pub(super) fn host_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]<>\"".contains(&b)
}

/// A byte a request-target holds as it is: RFC 3986's pchar and `/`, the
/// query's `?` aside (`%` is checked apart).
pub(super) fn target_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&b)
}

/// The request-target of the action's `path`, as the kubelet's request
/// would carry it: rooted, its fragment dropped, and what a target cannot
/// hold percent-encoded. A scheme and host in it (`http://x/y`) are the
/// kubelet's to replace: its path stays. Control characters, which the
/// kubelet's URL parser refuses too, are refused (the kubelet then sends
/// them percent-encoded; they name no path any server serves).
pub(super) fn request_target(path: &str) -> Result<String, String> {
    if path.bytes().any(is_ctl) {
        return Err(format!(
            "parse {path:?}: net/url: invalid control character in URL"
        ));
    }
    let escape = |part: &str, keep: &dyn Fn(u8) -> bool| -> String {
        let mut out = String::with_capacity(part.len());
        for b in part.bytes() {
            if keep(b) {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    };
    let valid_escapes = {
        let b = path.as_bytes();
        b.iter().enumerate().all(|(i, c)| {
            *c != b'%'
                || (b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                    && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
        })
    };
    let target = if valid_escapes {
        let reference = path.split('#').next().unwrap_or_default();
        // `scheme://host` or `//host` before the path: the kubelet puts its
        // own in their place.
        let rest = match scheme_of(reference) {
            Some((_, rest)) if rest.starts_with("//") => rest,
            _ => reference,
        };
        let rest = match rest.strip_prefix("//") {
            Some(after) => &after[after.find(['/', '?']).unwrap_or(after.len())..],
            None => rest,
        };
        let (p, query) = match rest.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };
        let keep = |b: u8| target_byte(b) || b == b'%';
        let mut t = String::from(if p.starts_with('/') { "" } else { "/" });
        t.push_str(&escape(p, &keep));
        if let Some(q) = query {
            t.push('?');
            t.push_str(&escape(q, &|b| keep(b) || b == b'?'));
        }
        t
    } else {
        // Go's parser refuses a bad escape, and the kubelet then takes the
        // whole of it as the path, escaped (`%zz?x` is `/%25zz%3Fx`).
        let prefix = if path.starts_with('/') { "" } else { "/" };
        format!("{prefix}{}", escape(path, &target_byte))
    };
    // Every byte is one a target may hold; the parser's word is final.
    http::uri::PathAndQuery::try_from(target.as_str())
        .map_err(|e| format!("parse {path:?}: {e}"))?;
    Ok(target)
}
