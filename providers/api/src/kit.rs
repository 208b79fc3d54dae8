//! Helpers every provider may use: bounded collections and durations read
//! from annotations.

use std::time::Duration;

use crate::duration;

/// A DNS label (RFC 1123): 1 to 63 lowercase alphanumerics and `-`,
/// alphanumeric at both ends; what Kubernetes wants of namespace and device names.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Gives back a collection's spare room once most of its entries are gone: a
/// hash map keeps the capacity of its largest size, so after 10,000 Pods come
/// and go it would hold their slots for good. Shrinks only when it is a quarter
/// full or less, so the cost (a rehash) is paid once per large drop, not per
/// removal.
pub fn release_spare<C: Spare>(collection: &mut C) {
    if collection.capacity() > 1024 && collection.capacity() / 4 > collection.len() {
        collection.shrink_to(collection.len() * 2);
    }
}

/// A collection [`release_spare`] can shrink.
pub trait Spare {
    fn capacity(&self) -> usize;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn shrink_to(&mut self, min_capacity: usize);
}

macro_rules! spare {
    ($t:ty, $($g:tt)*) => {
        impl<$($g)*> Spare for $t {
            fn capacity(&self) -> usize {
                self.capacity()
            }
            fn len(&self) -> usize {
                self.len()
            }
            fn shrink_to(&mut self, min_capacity: usize) {
                self.shrink_to(min_capacity);
            }
        }
    };
}
spare!(std::collections::HashMap<K, V, S>, K: std::hash::Hash + Eq, V, S: std::hash::BuildHasher);
spare!(std::collections::HashSet<K, S>, K: std::hash::Hash + Eq, S: std::hash::BuildHasher);
spare!(std::collections::VecDeque<T>, T);

/// Reads an annotation-style duration: "250us", "500ms", "3s", "2m", "1h" or
/// plain seconds, at most [`duration::MAX_DURATION`] (365 days) so that adding
/// it to a clock cannot overflow; [`duration::parse`] says what is wrong.
pub fn parse_duration(text: &str) -> Option<Duration> {
    duration::parse(text).ok()
}
