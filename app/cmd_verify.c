/* qflash verify: everything the loader checks (config, every safetensors header, shards named by
 * the index, every tensor's byte range, weight names, dtypes and shapes), plus the sha256 of each
 * file, compared with a sha256sum-style manifest when given. One line per problem; exit 0 only
 * when the model will load. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "format/sha256.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

static void print_problem(void *ud, const char *line) {
    (void)ud;
    printf("problem: %s\n", line);
}

/* What run and serve need beside the weights: a tokenizer within the model's vocabulary, and a
 * chat template (when there is one) that renders a conversation. */
static void check_tokenizer(const char *dir, int vocab, qf_diag *d) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    qf_tokenizer *t = NULL;
    if (access(path, R_OK) != 0) return qf_diag_report((qf_fail(QF_EIO, "%s is missing (run, chat and serve need it)", path), d));
    if (qf_tok_load(&t, dir) != QF_OK) return qf_diag_report(d);
    if (vocab > 0 && qf_tok_vocab_size(t) > vocab)
        qf_diag_report((qf_fail(QF_EFORMAT, "%s: the tokenizer has %d tokens, more than the model's vocab_size %d", path, qf_tok_vocab_size(t), vocab), d));
    const char *tmpl = qf_tok_chat_template(t);
    qf_chat_tmpl ct = {0};
    char *text = NULL;
    qf_chat_msg msgs[3] = {{"system", "You are helpful.", NULL}, {"user", "Hi", NULL}, {"assistant", "Hello", NULL}};
    if (tmpl && (qf_chat_tmpl_parse(&ct, tmpl) != QF_OK || qf_chat_render(&ct, msgs, 3, 1, 1, &text) != QF_OK)) {
        char why[512]; /* qf_fail writes where qf_last_error reads */
        snprintf(why, sizeof why, "%s", qf_last_error());
        qf_diag_report((qf_fail(QF_EFORMAT, "the chat template cannot be used: %s", why), d));
    }
    free(text);
    qf_chat_tmpl_free(&ct);
    qf_tok_free(t);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Hashes every regular file of dir (sorted), checking the manifest entries when given. */
static void hash_files(const char *dir, const char *manifest, qf_diag *d) {
    DIR *dp = opendir(dir);
    if (!dp) return;
    char *names[4096];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp)) && n < 4096) {
        char p[4096];
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (de->d_name[0] != '.' && stat(p, &sb) == 0 && S_ISREG(sb.st_mode)) names[n++] = strdup(de->d_name);
    }
    closedir(dp);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    FILE *mf = manifest ? fopen(manifest, "r") : NULL;
    if (manifest && !mf) qf_diag_report((qf_fail(QF_EIO, "%s: cannot open manifest", manifest), d));
    char (*hashes)[65] = calloc((size_t)n + 1, 65);
    for (int i = 0; i < n; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        if (qf_sha256_file(p, hashes[i]) == QF_OK) printf("sha256 %s  %s\n", hashes[i], names[i]);
        else qf_diag_report(d);
    }
    char line[8192];
    while (mf && fgets(line, sizeof line, mf)) {
        char want[65], name[4096];
        if (sscanf(line, "%64s %4095s", want, name) != 2) continue;
        const char *nm = name[0] == '*' ? name + 1 : name;
        int found = -1;
        for (int i = 0; i < n; i++)
            if (!strcmp(names[i], nm)) found = i;
        if (found < 0) qf_diag_report((qf_fail(QF_EIO, "%s: listed in the manifest but missing", nm), d));
        else if (strcasecmp(want, hashes[found]) != 0)
            qf_diag_report((qf_fail(QF_EFORMAT, "%s: sha256 %s does not match the manifest (%s)", nm, hashes[found], want), d));
    }
    if (mf) fclose(mf);
    for (int i = 0; i < n; i++) free(names[i]);
    free(hashes);
}

int cmd_verify(int argc, char **argv, qf_backend_opts *bo) {
    (void)bo; /* runs no model */
    const char *dir = NULL, *manifest = NULL;
    int hash = 1;
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, NULL, "--manifest")) manifest = cli_value(&a);
        else if (cli_is(&a, NULL, "--no-hash")) hash = 0;
        else if (cli_is(&a, "-m", "--model") && !dir) dir = cli_value(&a); /* as the other commands take it */
        else if (argv[a.i][0] != '-' && !dir) dir = argv[a.i];
        else {
            fprintf(stderr, "error: unknown option '%s' for verify\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (a.bad || !dir) {
        fprintf(stderr, "usage: qflash verify DIR [--manifest FILE] [--no-hash]\n");
        return 2;
    }
    qf_diag d = {print_problem, NULL, 0};
    qf_model *m = NULL;
    qf_load_opts lo = {&d, NULL, NULL};
    int rc = qf_model_load(&m, dir, &lo);
    if (rc != QF_OK && d.count == 0) qf_diag_report(&d); /* config-level failures come back as one error */
    int n_tensors = m ? m->st.n_tensors : 0, n_files = m ? m->st.n_files : 0;
    check_tokenizer(dir, m ? m->cfg.vocab : 0, &d);
    qf_flash_config fc;
    if (qf_flash_config_load(dir, &fc) != QF_OK) qf_diag_report(&d); /* config_flash.json, when there */
    qf_model_free(m);
    if (hash || manifest) hash_files(dir, manifest, &d);
    if (d.count) printf("FAILED: %d problem(s) in %s\n", d.count, dir);
    else printf("OK: %s will load (%d tensors in %d file(s))\n", dir, n_tensors, n_files);
    return d.count ? 1 : 0;
}
