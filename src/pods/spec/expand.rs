//! `$(VAR)` expansion, as the kubelet expands command, args and subPathExpr.

/// Expands `$(VAR)` from `env` the way the kubelet does: `$$` escapes, and an
/// unknown name is left as written.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    expand_with(text, |name| {
        env.iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    })
}

/// [`expand`] with the values from `lookup`.
pub(super) fn expand_with<'v>(
    text: &str,
    mut lookup: impl FnMut(&str) -> Option<&'v str>,
) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match lookup(name) {
                Some(v) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Expands a mount's `subPathExpr` as the kubelet does: every `$(VAR)` must
/// name a variable with a value, and the result must stay inside the volume
/// (relative, no `..`). Anything else leaves the container unconfigurable.
pub fn expand_sub_path(expr: &str, env: &[(String, String)]) -> Result<String, String> {
    let mut missing = std::collections::BTreeSet::new();
    let expanded = expand_with(expr, |name| {
        let value = env
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty());
        if value.is_none() {
            missing.insert(name.to_owned());
        }
        Some(value.unwrap_or(""))
    });
    if !missing.is_empty() {
        let names: Vec<String> = missing.into_iter().collect();
        return Err(format!("missing value for {}", names.join(", ")));
    }
    if expanded.starts_with('/') {
        return Err(format!(
            "error SubPath `{expanded}` must not be an absolute path"
        ));
    }
    if expanded.split('/').any(|s| s == "..") {
        return Err(format!(
            "unable to provision SubPath `{expanded}`: must not contain '..'"
        ));
    }
    Ok(expanded)
}
