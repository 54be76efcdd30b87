#include "format/sha256.h"

#include <errno.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

int qf_sha256_file(const char *path, char hex[65]) {
    FILE *f = fopen(path, "rb");
    if (!f) return qf_fail(QF_EIO, "%s: cannot open: %s", path, strerror(errno));
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char *buf = malloc(1 << 20);
    int rc = ctx && buf && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 ? QF_OK : qf_fail(QF_ENOMEM, "sha256: cannot start");
    size_t n;
    while (rc == QF_OK && (n = fread(buf, 1, 1 << 20, f)) > 0)
        if (EVP_DigestUpdate(ctx, buf, n) != 1) rc = qf_fail(QF_EIO, "sha256 failed on %s", path);
    if (rc == QF_OK && ferror(f)) rc = qf_fail(QF_EIO, "%s: read error", path);
    unsigned char md[32];
    unsigned int len = 0;
    if (rc == QF_OK && EVP_DigestFinal_ex(ctx, md, &len) != 1) rc = qf_fail(QF_EIO, "sha256 failed on %s", path);
    for (unsigned i = 0; rc == QF_OK && i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    EVP_MD_CTX_free(ctx);
    free(buf);
    fclose(f);
    return rc;
}
